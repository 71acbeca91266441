"""Summary of the scaling study (perf/train/scaling.py): from OUT/runs.jsonl it writes

  OUT/scaling.md         the tables: gap to dense AdamS per size, the lr sweeps, the peers at
                         equal bytes, what has not run yet, the trend fit and the targets
  OUT/gap_vs_size.png    gap to dense AdamS (final validation loss, %) against parameters on
                         a log axis, mean over seeds with the min-max spread, and the fit
  OUT/loss_vs_bytes.png  final validation loss against bytes sent per step per rank, one panel
                         per size

and with --results FILE replaces the part of FILE between "<!-- BEGIN scaling -->" and
"<!-- END scaling -->". It only reads runs.jsonl, so it can run while the study goes on.

    /usr/bin/python3 perf/train/scaling_summary.py perf/train/out-scaling \\
        [--results perf/RESULTS_training.md]
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN, END = "<!-- BEGIN scaling -->", "<!-- END scaling -->"
SWEPT = ["adamw", "adams", "scape-0.1", "scape-0.01"]
PEERS = ["topk-0.1", "topk-0.01", "powersgd@0.1", "powersgd@0.01"]
VARIANTS = ["scape-0.1-segrms", "scape-0.01-segrms"]
ORDER = SWEPT + VARIANTS + PEERS
LABEL = {
    "adamw": "dense AdamW (gloo all-reduce)", "adams": "dense AdamS (scape, density 1)",
    "scape-0.1": "SCAPE 0.1", "scape-0.01": "SCAPE 0.01",
    "scape-0.1-segrms": "SCAPE 0.1, entering=segment_rms",
    "scape-0.01-segrms": "SCAPE 0.01, entering=segment_rms",
    "topk-0.1": "top-k 0.1 + EF (sparse all-reduce, AdamW)",
    "topk-0.01": "top-k 0.01 + EF (sparse all-reduce, AdamW)",
    "powersgd@0.1": "PowerSGD hook, rank matched to SCAPE 0.1",
    "powersgd@0.01": "PowerSGD hook, rank matched to SCAPE 0.01",
}
PREDICT_AT = 5e8
COLOR = {g: f"C{i}" for i, g in enumerate(ORDER)}  # the same colour in every panel and plot


def load(out: str) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    runs = []
    path = os.path.join(out, "runs.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for x in f:
                try:
                    runs.append(json.loads(x))
                except ValueError:  # a line cut short by a kill (scaling.py redoes that run)
                    pass
    plans = {}
    for p in sorted(glob.glob(os.path.join(out, "plan-*.json"))):
        with open(p) as f:
            plans[os.path.basename(p)[5:-5]] = json.load(f)
    return runs, plans


def best_lr(runs: List[Dict[str, Any]], size: str, group: str) -> Optional[float]:
    sw = [r for r in runs if r["size"] == size and r["group"] == group and r["stage"] == "sweep"]
    if not sw:
        return None
    return min(sw, key=lambda r: (r["final_val_loss"], r["lr"]))["lr"]


PLANS: Dict[str, Any] = {}  # name -> plan-NAME.json (set by main)


def sweep_done(runs: List[Dict[str, Any]], size: str, group: str) -> bool:
    """Whether the sweep of `group` at `size` has all the points the schedule will give it (the
    grid, and the point beyond an edge winner), so that its best lr is final."""
    plan = next((p["plan"] for p in PLANS.values() if size in p["plan"]["sizes"]), None)
    lrs = sorted({r["lr"] for r in runs if r["size"] == size and r["group"] == group
                  and r["stage"] == "sweep"})
    if plan is None:
        return bool(lrs)
    n = len(plan["grids"]["scape" if group.startswith("scape") else group])
    if len(lrs) < n:
        return False
    if not plan.get("extend", True) or len(lrs) > n:
        return True
    return best_lr(runs, size, group) not in (lrs[0], lrs[-1])


def final_runs(runs: List[Dict[str, Any]], size: str, group: str) -> List[Dict[str, Any]]:
    """The runs that stand for a configuration at a size: a swept one's runs at its best lr
    (the sweep's seed 1 and the later seeds) once its sweep is done, any other's runs."""
    rs = [r for r in runs if r["size"] == size and r["group"] == group]
    if group in SWEPT:
        if not sweep_done(runs, size, group):
            return []
        lr = best_lr(runs, size, group)
        rs = [r for r in rs if r["lr"] == lr]
    return sorted(rs, key=lambda r: r["seed"])


def gaps(runs: List[Dict[str, Any]], size: str, group: str,
         base: str = "adams") -> Optional[np.ndarray]:
    """Per seed: final loss / the dense base's final loss at the same seed - 1, in % (the base:
    dense AdamS unless told). A seed without its partner uses the base's mean."""
    ref = {r["seed"]: r["final_val_loss"] for r in final_runs(runs, size, base)}
    rs = final_runs(runs, size, group)
    if not ref or not rs:
        return None
    mean_ref = float(np.mean(list(ref.values())))
    return np.array([100.0 * (r["final_val_loss"] / ref.get(r["seed"], mean_ref) - 1)
                     for r in rs])


def sizes_of(runs: List[Dict[str, Any]]) -> List[str]:
    s = {r["size"]: r["params"] for r in runs}
    return sorted(s, key=lambda k: s[k])


def params_of(runs: List[Dict[str, Any]], size: str) -> int:
    return next(r["params"] for r in runs if r["size"] == size)


def label_of(runs: List[Dict[str, Any]], size: str) -> str:
    """"0.022M params", "0.37M params", "1.8M params": two significant digits."""
    return f"{float(f'{params_of(runs, size) / 1e6:.2g}'):g}M params"


def complete(runs: List[Dict[str, Any]], size: str, group: str, seeds: int) -> bool:
    return len(final_runs(runs, size, group)) >= seeds


def fit(xs: List[float], ys: List[float]) -> Optional[Dict[str, float]]:
    """Least squares gap = a + b log10(params); the prediction at PREDICT_AT and its standard
    error from the residuals (meaningless with fewer than 3 points)."""
    if len(xs) < 2:
        return None
    x = np.log10(np.array(xs, dtype=float))
    y = np.array(ys, dtype=float)
    A = np.stack([np.ones_like(x), x], 1)
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    a, b = float(coef[0]), float(coef[1])
    x0 = math.log10(PREDICT_AT)
    pred = a + b * x0
    se = float("nan")
    if len(xs) > 2:
        resid = y - A @ coef
        s2 = float(resid @ resid) / (len(xs) - 2)
        cov = s2 * np.linalg.inv(A.T @ A)
        se = math.sqrt(float(np.array([1, x0]) @ cov @ np.array([1, x0])))
    out = {"a": a, "b": b, "pred": pred, "se": se, "n": len(xs)}
    if all(v > 0 for v in ys) and len(xs) > 1:  # power law gap = c P^k
        k, c = np.polyfit(x, np.log10(y), 1)
        out["k"] = float(k)
        out["pred_pow"] = float(10 ** (c + k * x0))
    return out


def fmt_range(v: np.ndarray, d: int = 4, pct: bool = False) -> str:
    f = (lambda t: f"{t:+.1f}%") if pct else (lambda t: f"{t:.{d}f}")
    if len(v) == 1:
        return f"{f(v[0])} (1 seed)"
    return f"{f(v.mean())} ({f(v.min())} to {f(v.max())})"


def tables(runs: List[Dict[str, Any]], plans: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    sizes = sizes_of(runs)
    seeds = max([p["plan"]["seeds"] for p in plans.values()] or [2])
    lines: List[str] = []
    # -- gap table ------------------------------------------------------------------------
    head = "| configuration | " + " | ".join(label_of(runs, s) for s in sizes) + " |"
    lines += ["Gap of the final validation loss to dense AdamS at the same seed (mean over "
              "seeds, min to max), and the configuration's peak lr:", "", head,
              "|---|" + "---|" * len(sizes)]
    for g in ORDER:
        cells = []
        for s in sizes:
            v = gaps(runs, s, g) if g != "adams" else None
            rs = final_runs(runs, s, g)
            if g == "adams" and rs:
                cells.append(f"{fmt_range(np.array([r['final_val_loss'] for r in rs]))} "
                             f"(loss), lr {rs[0]['lr']:g}")
            elif v is None or not len(v):
                cells.append("not yet run")
            else:
                extra = ""
                if g.startswith("powersgd"):
                    extra = f", rank {rs[0]['powersgd_rank']}"
                cells.append(f"{fmt_range(v, pct=True)}, lr {rs[0]['lr']:g}{extra}")
        lines.append(f"| {LABEL[g]} | " + " | ".join(cells) + " |")
    # -- against its own dense optimizer ------------------------------------------------------
    lines += ["", "The same gap against each method's own dense optimizer (SCAPE: dense AdamS; "
              "top-k and PowerSGD, which feed AdamW: dense AdamW), so that the base optimizer's "
              "own difference does not count for or against the compression:", "", head,
              "|---|" + "---|" * len(sizes)]
    for g in ["scape-0.1", "scape-0.01", "scape-0.1-segrms", "scape-0.01-segrms"] + PEERS:
        base = "adams" if g.startswith("scape") else "adamw"
        cells = []
        for s in sizes:
            v = gaps(runs, s, g, base)
            cells.append("not yet run" if v is None or not len(v) else
                         f"{fmt_range(v, pct=True)} vs {base}")
        lines.append(f"| {LABEL[g]} | " + " | ".join(cells) + " |")
    # -- per size detail --------------------------------------------------------------------
    lines += ["", "Every configuration at its lr (final validation loss over seeds, bytes sent "
              "per step per rank, CPU seconds of a run summed over the ranks):", "",
              "| size | configuration | steps x batch | tokens/param | peak lr | seeds | final val "
              "loss | bytes/step/rank | fraction sent | CPU s/run | ranks identical |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in sizes:
        for g in ORDER:
            rs = final_runs(runs, s, g)
            if not rs:
                continue
            v = np.array([r["final_val_loss"] for r in rs])
            r0 = rs[0]
            lines.append(
                f"| {label_of(runs, s)} | `{g}` | {r0['steps']} x {r0['batch']}x{r0['context']}"
                f"x{r0['world_size']} | {r0['tokens_per_param']:.2f} | {r0['lr']:g} "
                f"| {len(rs)} | {fmt_range(v)} | {np.mean([r['bytes_per_step'] for r in rs]):,.0f}"
                f" | {np.mean([r['avg_sent_fraction'] for r in rs]):.4f} "
                f"| {np.mean([r.get('cpu_seconds_all_ranks', float('nan')) for r in rs]):.0f} "
                f"| {'yes' if all(r['ranks_identical'] for r in rs) else 'NO'} |")
    # -- PowerSGD's rank arithmetic -------------------------------------------------------
    ps = [r for r in runs if r["opt"] == "powersgd"]
    if ps:
        lines += ["", "PowerSGD's matrix rank per size: the rank whose bytes per step (the hook's "
                  "rule: P and Q of each matrix with (n+m) r x 2 < n m, every other tensor "
                  "uncompressed, the first 2 steps uncompressed; ring volume 2(W-1)/W x 4 B per "
                  "element) come closest to the SCAPE runs' measured mean at that size:", "",
                  "| size | configuration | SCAPE bytes/step/rank (target) | rank | predicted "
                  "bytes/step/rank | measured (hook's own element count) |",
                  "|---|---|---|---|---|---|"]
        for s in sizes:
            for g in ("powersgd@0.1", "powersgd@0.01"):
                rs = final_runs(runs, s, g)
                if rs:
                    r0 = rs[0]
                    pred = r0.get("powersgd_bytes_predicted", 0.0)
                    lines.append(f"| {label_of(runs, s)} | `{g}` | {r0['match_bytes']:,.0f} "
                                 f"| {r0['powersgd_rank']} | "
                                 f"{f'{pred:,.0f}' if pred else 'not recorded'} | "
                                 f"{np.mean([r['bytes_per_step'] for r in rs]):,.0f} |")
    # -- sweeps -----------------------------------------------------------------------------
    lines += ["", "The lr sweeps (seed 1; **bold** the best; an edge winner got one more grid "
              "point beyond it):", "", "| size | configuration | final val loss at peak lr |",
              "|---|---|---|"]
    for s in sizes:
        for g in SWEPT:
            sw = sorted((r for r in runs if r["size"] == s and r["group"] == g
                         and r["stage"] == "sweep"), key=lambda r: r["lr"])
            if not sw:
                continue
            b = best_lr(runs, s, g)
            cells = [(f"**{r['lr']:g}: {r['final_val_loss']:.4f}**" if r["lr"] == b else
                      f"{r['lr']:g}: {r['final_val_loss']:.4f}") for r in sw]
            edge = " (best at the edge)" if b in (sw[0]["lr"], sw[-1]["lr"]) and len(sw) > 1 \
                else ""
            lines.append(f"| {label_of(runs, s)} | `{g}` | {', '.join(cells)}{edge} |")
    # -- fit --------------------------------------------------------------------------------
    info: Dict[str, Any] = {"fits": {}, "sizes": sizes, "seeds": seeds}
    lines += ["", "Trend: least squares of the mean gap against log10(parameters) over the "
              "sizes where the configuration and dense AdamS finished all seeds; and, where "
              "every gap is positive, a power law gap = c P^k:", "",
              "| configuration | sizes | slope (points of gap per 10x params) | predicted gap at "
              "500M params (linear, +- 1 s.e.) | power law k | predicted at 500M (power law) |",
              "|---|---|---|---|---|---|"]
    for g in ["scape-0.1", "scape-0.01", "scape-0.1-segrms", "scape-0.01-segrms"] + PEERS + [
            "adamw"]:
        xs, ys = [], []
        for s in sizes:
            v = gaps(runs, s, g)
            if v is not None and complete(runs, s, g, seeds) and complete(runs, s, "adams",
                                                                           seeds):
                xs.append(params_of(runs, s))
                ys.append(float(v.mean()))
        f = fit(xs, ys)
        if f is None:
            continue
        info["fits"][g] = dict(f, xs=xs, ys=ys)
        pw = "n/a (a gap <= 0) | n/a"
        if "k" in f:
            pw = f"{f['k']:+.2f} | " + (f"{f['pred_pow']:+.1f}%" if f["pred_pow"] < 1000 else
                                        "over +1000% (meaningless)")
        lines.append(f"| {LABEL[g]} | {f['n']} | {f['b']:+.2f} | {f['pred']:+.1f}% "
                     f"(+- {f['se']:.1f}) | {pw} |")
    return "\n".join(lines), info


def status(runs: List[Dict[str, Any]], plans: Dict[str, Any]) -> str:
    """What each plan's sizes still lack (counts only; the schedule decides the details)."""
    lines = ["| plan | size | finished runs | missing |", "|---|---|---|---|"]
    for name, p in plans.items():
        if name == "smoke":
            continue
        seeds = p["plan"]["seeds"]
        for s in p["plan"]["sizes"]:
            done = [r for r in runs if r["size"] == s]
            miss = []
            for g in SWEPT + PEERS + VARIANTS:
                k = len(final_runs(runs, s, g))
                n_sweep = len({r["lr"] for r in done if r["group"] == g and r["stage"] == "sweep"})
                if g in SWEPT and n_sweep < 3:
                    miss.append(f"{g} sweep ({n_sweep} of 3+ lrs)")
                elif k < seeds:
                    miss.append(f"{g} ({k} of {seeds} seeds)")
            lines.append(f"| {name} | {s} | {len(done)} | {'; '.join(miss) or 'none'} |")
    return "\n".join(lines)


def targets(runs: List[Dict[str, Any]], info: Dict[str, Any]) -> str:
    """Issue 23 item 4 at the largest size where dense AdamS finished its seeds."""
    seeds = info["seeds"]
    done = [s for s in info["sizes"] if complete(runs, s, "adams", seeds)]
    if not done:
        return "No size has finished dense AdamS yet: every target is **not yet measured**."
    s = done[-1]
    out = [f"At the largest size where dense AdamS has all {seeds} seeds so far, "
           f"**{label_of(runs, s)}** (not the study's largest planned size unless it is the "
           f"last in the status table):", "",
           "| target | measured | verdict |", "|---|---|---|"]
    for d, lim in (("0.1", 2.0), ("0.01", 5.0)):
        cands = []
        for g in (f"scape-{d}", f"scape-{d}-segrms"):
            v = gaps(runs, s, g)
            if v is not None and complete(runs, s, g, seeds):
                cands.append((float(v.mean()), g, v))
        if not cands:
            out.append(f"| best SCAPE {d} variant within {lim:g}% of dense AdamS | no complete "
                       f"run | **not yet measured** |")
        else:
            m, g, v = min(cands)
            tried = ", ".join(f"`{c[1]}` {c[0]:+.1f}%" for c in cands)
            var = "" if any(c[1].endswith("segrms") for c in cands) else \
                " (entering=segment_rms not yet run: the paper's default only)"
            out.append(f"| best SCAPE {d} variant within {lim:g}% of dense AdamS | {tried}; "
                       f"best `{g}` {fmt_range(v, pct=True)}{var} | "
                       f"**{'met' if v.mean() <= lim else 'missed'}** (mean over seeds) |")
        ps = final_runs(runs, s, f"powersgd@{d}")
        sc = [c for c in cands]
        if not ps or not sc:
            out.append(f"| SCAPE {d} below PowerSGD at equal bytes | - | **not yet measured** |")
        else:
            best_g = min(sc)[1]
            sv = np.array([r["final_val_loss"] for r in final_runs(runs, s, best_g)])
            pv = np.array([r["final_val_loss"] for r in ps])
            sb = np.mean([r["bytes_per_step"] for r in final_runs(runs, s, best_g)])
            pb = np.mean([r["bytes_per_step"] for r in ps])
            out.append(f"| SCAPE {d} below PowerSGD at equal bytes | `{best_g}` {sv.mean():.4f} "
                       f"at {sb:,.0f} B/step vs PowerSGD rank {ps[0]['powersgd_rank']} "
                       f"{pv.mean():.4f} at {pb:,.0f} B/step | "
                       f"**{'met' if sv.mean() < pv.mean() else 'missed'}** |")
    return "\n".join(out)


def plots(runs: List[Dict[str, Any]], info: Dict[str, Any], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = info["sizes"]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for g in ["scape-0.1", "scape-0.01", "scape-0.1-segrms", "scape-0.01-segrms", "topk-0.1",
              "topk-0.01", "powersgd@0.1", "powersgd@0.01", "adamw"]:
        xs, m, lo, hi = [], [], [], []
        for s in sizes:
            v = gaps(runs, s, g)
            if v is None or not len(v):
                continue
            xs.append(params_of(runs, s))
            m.append(v.mean())
            lo.append(v.mean() - v.min())
            hi.append(v.max() - v.mean())
        if not xs:
            continue
        style = "-o" if g.startswith("scape") else ("--s" if g != "adamw" else ":^")
        ln = ax.errorbar(xs, m, yerr=[lo, hi], fmt=style, capsize=3, label=LABEL[g],
                         color=COLOR[g])
        f = info["fits"].get(g)
        if f and g.startswith("scape"):
            xx = np.logspace(math.log10(min(xs)), math.log10(max(xs)), 20)
            ax.plot(xx, f["a"] + f["b"] * np.log10(xx), color=ln[0].get_color(), alpha=0.4,
                    lw=1)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("final validation loss vs dense AdamS (%)")
    ax.set_title("gap to dense AdamS against model size (mean over seeds, bars: min-max); "
                 "thin lines: linear fit in log10(params)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "gap_vs_size.png"), dpi=110)
    plt.close(fig)

    n = len(sizes)
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.5 * rows), squeeze=False)
    for ax, s in zip(axes.flat, sizes):
        for g in ORDER:
            rs = final_runs(runs, s, g)
            if not rs:
                continue
            v = np.array([r["final_val_loss"] for r in rs])
            b = np.mean([r["bytes_per_step"] for r in rs])
            mk = "o" if g.startswith("scape") else ("s" if g.startswith(("topk", "powersgd"))
                                                   else "^")
            ax.errorbar([b], [v.mean()], yerr=[[v.mean() - v.min()], [v.max() - v.mean()]],
                        fmt=mk, capsize=3, label=g, color=COLOR[g])
        ax.set_xscale("log")
        ax.set_title(label_of(runs, s), fontsize=9)
        ax.set_xlabel("bytes sent per step per rank")
        ax.set_ylabel("final validation loss")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("final validation loss against bytes per step (lower left is better)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss_vs_bytes.png"), dpi=100)
    plt.close(fig)


def report(runs: List[Dict[str, Any]], plans: Dict[str, Any], out: str) -> str:
    body, info = tables(runs, plans)
    cpu = sum(r.get("cpu_seconds_all_ranks", 0.0) for r in runs)
    wall = sum(r.get("wall_seconds", 0.0) for r in runs)
    p = next(iter(plans.values()), {})
    corp = p.get("corpus", {})
    head = [f"{len(runs)} runs in `{os.path.join(out, 'runs.jsonl')}`: {wall / 3600:.2f} h of "
            f"wall time and {cpu / 3600:.2f} h of CPU time (all ranks) on a machine shared with "
            f"other jobs; {p.get('world_size', '?')} ranks, torch {p.get('torch', '?')}, "
            f"entering=segment_rms available when the last plan started: "
            f"{p.get('variant_available', '?')}. Text: Debian `fortunes` "
            f"{corp.get('version', '?')} (SHA-256 {str(corp.get('sha256', '?'))[:12]}...).",
            "", body, "", "Status of the plans:", "", status(runs, plans), "",
            "Targets of issue 23 item 4:", "", targets(runs, info), "",
            f"Plots: `{os.path.join(out, 'gap_vs_size.png')}`, "
            f"`{os.path.join(out, 'loss_vs_bytes.png')}`."]
    return "\n".join(head), info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--results", help="markdown file whose scaling section to replace")
    a = ap.parse_args()
    runs, plans = load(a.out)
    PLANS.update(plans)
    runs = [r for r in runs if r.get("stage")]
    if not runs:
        print("scaling_summary: no runs", file=sys.stderr)
        return 1
    text, info = report(runs, plans, a.out)
    with open(os.path.join(a.out, "scaling.md"), "w") as f:
        f.write(text + "\n")
    plots(runs, info, a.out)
    print(text)
    if a.results:
        with open(a.results) as f:
            doc = f.read()
        if BEGIN not in doc or END not in doc:
            print(f"scaling_summary: {a.results} has no scaling section", file=sys.stderr)
            return 1
        head, rest = doc.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        with open(a.results, "w") as f:
            f.write(head + BEGIN + "\n" + text + "\n" + END + tail)
    bad = [r["key"] for r in runs if not r["ranks_identical"]]
    if bad:
        print(f"scaling_summary: ranks diverged in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
