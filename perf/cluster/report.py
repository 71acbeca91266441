#!/usr/bin/env python3
"""Tables and the plot of an emulated-cluster run (cluster.py's OUT): per (P, link setting) the
measured tokens/s and step split of each method, perf/model.py's prediction beside each
measured tokens/s (fed the measured compute and link figures), the mask sync's hidden fraction,
and tokens/s against the link rate (OUT/cluster.png). Writes OUT/report.md and prints it.

    python3 perf/cluster/report.py OUT
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
PERF = os.path.dirname(HERE)
sys.path.insert(0, PERF)


def _load_step_model():  # type: ignore[no-untyped-def]
    """perf/model.py, the analytic step-time model (by path: perf/train/model.py is the GPT)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scape_step_model",
                                                  os.path.join(PERF, "model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


step_model = _load_step_model()
sys.path.insert(0, os.path.join(PERF, "train"))

ORDER = ["adamw", "adams", "scape-0.1", "scape-0.01", "scape-0.01-e4m3", "powersgd"]
LABEL = {"adamw": "dense AdamW (torch, gloo)", "adams": "dense AdamS (ScapeAdamS d=1)",
         "scape-0.1": "SCAPE 0.1", "scape-0.01": "SCAPE 0.01",
         "scape-0.01-e4m3": "SCAPE 0.01, e4m3 payload",
         "powersgd": "PowerSGD+EF (torch hook)"}


def load(out: str) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    rows = []
    with open(os.path.join(out, "results.jsonl")) as f:
        for ln in f:
            if ln.strip():
                rows.append(json.loads(ln))
    sts: List[Dict[str, Any]] = []
    names = sorted((x for x in os.listdir(out) if x.startswith("state") and x.endswith(".json")),
                   key=lambda x: (len(x), x))
    for x in names:  # state.json, then state-1.json ... of --append runs
        with open(os.path.join(out, x)) as f:
            sts.append(json.load(f))
    return rows, sts


def powersgd_elements(row: Dict[str, Any]) -> Tuple[int, int]:
    """(elements of the P all-reduce, of the Q all-reduce) per compressed step: torch's hook
    all-reduces the uncompressed tensors with P, then Q (scaling.powersgd_elements's rule)."""
    import scaling

    shapes = scaling.param_shapes(row["size"], 64)
    r = row["powersgd_rank"]
    p_el = q_el = 0
    for s in shapes:
        n = s[0]
        m = 1
        for d in s[1:]:
            m *= d
        k = min(n, m, r)
        if len(s) > 1 and (n + m) * k * 2.0 < n * m:
            p_el += n * k
            q_el += m * k
        else:
            p_el += n * m
    return p_el, q_el


def link_figures(group: List[Dict[str, Any]]) -> Tuple[float, float, float]:
    """(bytes/s of payload, latency per message (s), goodput fraction) of one (P, link):
    the tbf rate times the fraction of the wire bytes that were payload in the dense AdamS
    run (TCP/IP/Ethernet headers, UCX headers, acks), and the 8-byte all-gather's time /
    (P - 1)."""
    P = group[0]["P"]
    rate = group[0]["rate_mbit"] * 1e6 / 8 if group[0]["rate_mbit"] else 0.0
    fr = [r["lib_bytes_sent_per_step"] / r["tx_bytes_per_step_max_over_ranks"]
          for r in group if r["method"] == "adams" and r.get("tx_bytes_per_step_max_over_ranks")]
    good = fr[0] if fr else 0.94
    lat = [r["agreement_s"] / max(1, P - 1) for r in group if "agreement_s" in r]
    a = statistics.median(lat) if lat else 1e-4
    return rate * good, a, good


def predict(row: Dict[str, Any], bw: float, lat: float, slowest: bool = True) -> Optional[float]:
    """perf/model.py's step time for this method, fed its measured compute (forward+backward)
    and local optimizer time, and the link's measured figures. The compute is the slowest
    rank's (rank 0's plus its wait for slower ranks at the step's first exchange): ranks in
    lockstep all wait for it, which the model's single compute figure has to carry. With
    slowest=False, rank 0's own (the model fed as before 2026-12-07)."""
    if bw <= 0:
        return None
    P, n = row["world_size"], row["params"]
    c = row["compute_s"] + max(0.0, row["optimizer_s"])
    if slowest:
        c += row.get("wait_slower_ranks_s", 0.0)
    m = row["method"]
    if m in ("adamw", "adams"):
        return step_model.step_times(n, P, bw, lat, c, 1.0)["dense_step_s"]
    if m.startswith("scape"):
        d = float(m.split("-")[1])
        vb = 1 if m.endswith("-e4m3") else 4  # the payload's bytes per value
        return step_model.step_times(n, P, bw, lat, c, d, value_bytes=vb)["scape_step_s"]
    if m == "powersgd":  # two all-reduces (P, then Q); the hook's own matmuls/QR not priced
        p_el, q_el = powersgd_elements(row)
        return (c + step_model.ring_allreduce_s(4 * p_el, P, bw, lat)
                + step_model.ring_allreduce_s(4 * q_el, P, bw, lat))
    return None


def fmt_b(x: float) -> str:
    return f"{x / 1e6:.2f} MB" if x >= 1e6 else f"{x / 1e3:.1f} kB"


def report(out: str) -> str:
    rows, sts = load(out)
    groups: Dict[Tuple[int, str], List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["P"], r["link"]), []).append(r)
    keys = sorted(groups, key=lambda k: (k[0], groups[k][0].get("ratio_target") or 0))
    L: List[str] = []
    for st in sts:
        L.append(f"Run `cluster.py {' '.join(st.get('argv') or [])}`: start {st.get('date')} "
                 f"({st.get('uptime')}), end {st.get('end', {}).get('date', '?')} "
                 f"({st.get('end', {}).get('uptime', '')}); {st.get('cores')} cores, kernel "
                 f"{st.get('kernel')}, git {st.get('git')}, mode {st.get('mode')}. Timings are "
                 f"noisy: the cores are shared with other work.")
        L.append("")
    notes = {r.get("shaping_note") for r in rows if r.get("shaping_note")}
    for nt in notes:
        L.append(f"Shaping: {nt}.")
        L.append("")
    for key in keys:
        g = sorted(groups[key], key=lambda r: ORDER.index(r["method"]))
        r0 = g[0]
        bw, lat, good = link_figures(g)
        L.append(f"### P = {key[0]}, {key[1]}: target ratio {r0.get('ratio_target')}, "
                 + (f"{r0['rate_mbit']:g} Mbit/s per link" if r0["rate_mbit"] else
                    "no tbf (the veths' own capacity)"))
        L.append("")
        L.append(f"{r0['params']:,} parameters ({r0['size']}), {r0['batch']} x 64 tokens per "
                 f"rank per step, {r0['steps_timed']} timed steps after {r0['warmup']}; "
                 f"compute calibrated at {r0.get('calib_compute_s', 0):.3f} s/step; link fed to "
                 f"the model: {bw * 8 / 1e6:.1f} Mbit/s of payload ({good:.0%} of the wire "
                 f"bytes), {lat * 1e3:.2f} ms per message.")
        L.append("")
        L.append("| method | tokens/s | step (s) | compute | wait for slower ranks | exchange | "
                 "exposed sync | optimizer | other | wire B/step (veth tx) | lib/est. B/step | "
                 "loss after N | x dense AdamS |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        base = next((r["tokens_per_second"] for r in g if r["method"] == "adams"), None)
        for r in g:
            lib = r.get("lib_bytes_sent_per_step", r.get("bytes_per_step_study_estimate", 0))
            if r["method"] == "powersgd":  # steady state: the P and Q all-reduces' ring volume
                lib = 2.0 * (r["world_size"] - 1) / r["world_size"] * 4 * sum(
                    powersgd_elements(r))
            extra = f" (rank {r['powersgd_rank']})" if r["method"] == "powersgd" else ""
            L.append(f"| {LABEL[r['method']]}{extra} | {r['tokens_per_second']:.0f} | "
                     f"{r['step_s']:.3f} | {r['compute_s']:.3f} | "
                     f"{r.get('wait_slower_ranks_s', 0):.3f} | {r['exchange_s']:.3f} | "
                     f"{r['sync_wait_s']:.3f} | {r['optimizer_s']:.3f} | {r['other_s']:.3f} | "
                     f"{fmt_b(r['tx_bytes_per_step_max_over_ranks'])} | {fmt_b(lib)} | "
                     f"{r['loss_final_train']:.3f} | "
                     + (f"{r['tokens_per_second'] / base:.2f} |" if base else "- |"))
        L.append("")
        if bw > 0:
            L.append("| method | measured tokens/s | perf/model.py tokens/s (fed the slowest "
                     "rank's compute) | predicted / measured | ... fed rank 0's compute | "
                     "exchange + sync measured (s) | wire bytes / rate (s) |")
            L.append("|---|---|---|---|---|---|---|")
            for r in g:
                t = predict(r, bw, lat)
                t0 = predict(r, bw, lat, slowest=False)
                if t is None or t0 is None:
                    continue
                pt = r["tokens_per_step"] / t
                q = pt / r["tokens_per_second"]
                flag = " **>20% off**" if abs(q - 1) > 0.2 else ""
                q2 = r["tokens_per_step"] / t0 / r["tokens_per_second"]
                flag2 = " **>20% off**" if abs(q2 - 1) > 0.2 else ""
                wire = r["tx_bytes_per_step_max_over_ranks"] * 8 / (r["rate_mbit"] * 1e6)
                L.append(f"| {LABEL[r['method']]} | {r['tokens_per_second']:.0f} | {pt:.0f} | "
                         f"{q:.2f}{flag} | {q2:.2f}{flag2} | "
                         f"{r['exchange_s'] + r['sync_wait_s']:.3f} | "
                         f"{wire:.3f} |")
            L.append("")
        sc = [r for r in g if r["method"].startswith("scape") and "mask_sync_blocking_s" in r]
        if sc:
            L.append("| mask sync | mask B/step (lib) | blocking sync (s) | agreement (s) | "
                     "sync_wait phase (s) | blocked on the sync (s) | hidden | hidden, from "
                     "the phase less the agreement |")
            L.append("|---|---|---|---|---|---|---|---|")
            for r in sc:
                h = r.get("sync_hidden_fraction")
                hp = r.get("sync_hidden_fraction_phase", h if "mask_wait_s" not in r else None)
                mw = r.get("mask_wait_s")
                L.append(f"| {LABEL[r['method']]} | {fmt_b(r['lib_mask_bytes_per_step'])} | "
                         f"{r['mask_sync_blocking_s']:.4f} | {r['agreement_s']:.4f} | "
                         f"{r['sync_wait_s']:.4f} | {'-' if mw is None else f'{mw:.4f}'} | "
                         f"{'' if h is None else f'{h:.0%}'} | "
                         f"{'' if hp is None else f'{hp:.0%}'} |")
            L.append("")
    # where SCAPE starts to win
    for P in sorted({k[0] for k in keys}):
        pts = sorted(((groups[k][0]["rate_mbit"], {r["method"]: r["tokens_per_second"]
                                                   for r in groups[k]})
                      for k in keys if k[0] == P and groups[k][0]["rate_mbit"]), reverse=True)
        for m in ("scape-0.1", "scape-0.01"):
            won = [rate for rate, d in pts if m in d and all(
                d[m] > d[o] for o in ("adamw", "adams") if o in d)]
            lost = [rate for rate, d in pts if m in d and rate not in won]
            if any(m in d for _, d in pts):
                L.append(f"P = {P}: {LABEL[m]} beats both dense methods at "
                         f"{', '.join(f'{x:g}' for x in won) or 'no'} Mbit/s"
                         f"{'; not at ' + ', '.join(f'{x:g}' for x in lost) if lost else ''}.")
    L.append("")
    plot(out, groups, keys)
    txt = "\n".join(L)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(txt + "\n")
    return txt


def plot(out: str, groups: Dict[Tuple[int, str], List[Dict[str, Any]]],
         keys: List[Tuple[int, str]]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    Ps = sorted({k[0] for k in keys if groups[k][0]["rate_mbit"]})
    if not Ps:
        return
    fig, axes = plt.subplots(1, len(Ps), figsize=(6 * len(Ps), 4.2), squeeze=False)
    for ax, P in zip(axes[0], Ps):
        for m in ORDER:
            pts = sorted((groups[k][0]["rate_mbit"], r["tokens_per_second"])
                         for k in keys if k[0] == P for r in groups[k]
                         if r["method"] == m and groups[k][0]["rate_mbit"])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=LABEL[m])
        for k in keys:
            if k[0] == P and not k[1].startswith("r") and groups[k][0]["rate_mbit"]:
                ax.axvline(groups[k][0]["rate_mbit"], color="grey", ls=":", lw=0.8)
                ax.text(groups[k][0]["rate_mbit"], ax.get_ylim()[1] * 0.02, k[1], rotation=90,
                        fontsize=7, color="grey", va="bottom")
        ax.set_xscale("log")
        from matplotlib.ticker import NullFormatter, ScalarFormatter
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        rates = sorted({groups[k][0]["rate_mbit"] for k in keys
                        if k[0] == P and groups[k][0]["rate_mbit"]})
        ax.set_xticks(rates)
        ax.set_xticklabels([f"{x:g}" for x in rates], fontsize=7)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("link rate per host (Mbit/s, tbf)")
        ax.set_ylabel("tokens/s (all ranks)")
        ax.set_title(f"P = {P} emulated hosts (shared 2-core VM: noisy)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "cluster.png"), dpi=110)


if __name__ == "__main__":
    print(report(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "out")))
