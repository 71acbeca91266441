"""The report of perf/gpu/gpu_train.sh length: reads OUT/length_runs.jsonl (perf/gpu/gpu_length.py)
and OUT/length_plan.json, writes OUT/gpu_length.md (a Markdown section ready to paste into
perf/RESULTS_gpu.md: the gap to dense AdamS against training tokens per parameter) and
OUT/length_gap.png (when matplotlib is there).

The corpus's unigram / bigram cross-entropies, the plateau flag and the dense-step equivalent
are perf/train/quality_summary.py's (imported), as in the CPU study's tables.

    python3 perf/gpu/gpu_length_report.py --out DIR [--meta FILE] [--corpus DIR] [--dry-run]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "train"))

import quality_summary as qs  # noqa: E402  (perf/train/quality_summary.py)

DENSE = "adams"


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    out.append(json.loads(line))
    return out


def label(method: str) -> str:
    """adams -> dense AdamS, scape-0.1 -> SCAPE 0.1, scape-0.1-artifact -> SCAPE 0.1 (artifact)"""
    if method == DENSE:
        return "dense AdamS"
    if method == "adamw":
        return "AdamW (DDP)"
    parts = method.split("-", 2)
    if parts[0] == "scape" and len(parts) >= 2:
        return f"SCAPE {parts[1]}" + (f" ({parts[2]})" if len(parts) > 2 else "")
    return method


def baselines(corpus_dir: str) -> Tuple[Optional[Dict[str, float]], str]:
    """The corpus's unigram / bigram cross-entropies (quality_summary.ngram_baselines) on the
    corpus the runs read (a bundled copy, or Debian's package), or None and why not."""
    try:
        import gpu_train  # the corpus loader of the runs (imports torch)

        return qs.ngram_baselines(gpu_train.load_corpus(corpus_dir or None)), ""
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the report goes on without them
        return None, f"{type(e).__name__}: {e}"


def steps_note(r: Dict[str, Any]) -> str:
    return (f" (truncated: {r['steps_done']} of {r['steps']} steps, not comparable)"
            if r.get("truncated") else "")


def length_table(runs: List[Dict[str, Any]], methods: List[str],
                 base: Optional[Dict[str, float]]) -> Tuple[List[str], List[Dict[str, Any]]]:
    """Rows per length run: the final validation loss of each method, and for the others the
    gap to dense AdamS at the same length in % and nats and the dense-step equivalent."""
    by: Dict[float, Dict[str, Dict[str, Any]]] = defaultdict(dict)
    for r in runs:
        by[r["tokens_per_param_requested"]][r["method"]] = r
    lines = ["| tokens/param (steps) | " + " | ".join(label(m) for m in methods) + " |",
             "|---|" + "---|" * len(methods)]
    rows = []
    fl = (lambda v: qs.flag(v, base)) if base else (lambda v: "")
    for req in sorted(by):
        got = by[req]
        any_r = next(iter(got.values()))
        # the requested length (its steps rounded to whole steps), or what it was shrunk to
        head = f"{req:g} ({any_r['steps']})"
        if any_r.get("length_status") == "shrunk":
            head = (f"{any_r['tokens_per_param_planned']:.3g} ({any_r['steps']}; {req:g} "
                    "requested)")
        dense = got.get(DENSE)
        cells = [head]
        gaps: Dict[str, Tuple[float, float]] = {}
        for m in methods:
            r = got.get(m)
            if r is None:
                cells.append("not run")
                continue
            v = r["final_val_loss"]
            cell = f"{v:.3f}{fl(v)}"
            if m != DENSE and dense is not None:
                dv = dense["final_val_loss"]
                _, eq = qs.dense_steps_to(dense["curve"], v)
                gaps[m] = (100 * (v - dv) / dv, v - dv)
                cell += f": {gaps[m][0]:+.1f}% ({gaps[m][1]:+.3f} nats), = dense step {eq}"
            cells.append(cell + steps_note(r))
        lines.append("| " + " | ".join(cells) + " |")
        rows.append({"requested": req, "tokens_per_param": any_r["tokens_per_param_planned"],
                     "steps": any_r["steps"], "gaps": gaps,
                     "loss": {m: got[m]["final_val_loss"] for m in got}})
    return lines, rows


def speed_table(runs: List[Dict[str, Any]], methods: List[str],
                lrs: Dict[str, float]) -> List[str]:
    lines = ["| method | options | peak lr | payload | step ms (mean, slowest rank) | tokens/s | "
             "bytes sent/step/rank | ranks identical at every evaluation |",
             "|---|---|---|---|---|---|---|---|"]
    for m in methods:
        rs = [r for r in runs if r["method"] == m]
        if not rs:
            lines.append(f"| {label(m)} | | {lrs.get(m, '')} | | not run | | | |")
            continue
        steps = sum(r["steps_done"] for r in rs)
        secs = sum(r["train_seconds_slowest_rank"] for r in rs)
        toks = sum(r["tokens"] for r in rs)
        byts = sum(r["bytes_per_step"] * r["steps_done"] for r in rs)
        opt = gpu_opts(m) if rs[0]["opt"] == "scape" else ""
        lines.append(f"| {label(m)} | {opt} | {rs[0]['lr']:g} | {rs[0]['payload']} | "
                     f"{1e3 * secs / max(1, steps):.1f} | "
                     f"{toks / secs if secs else 0:,.0f} | {byts / max(1, steps):,.0f} | "
                     f"{'yes' if all(r['ranks_identical'] for r in rs) else 'NO'} |")
    return lines


def plot(out: str, rows: List[Dict[str, Any]], methods: List[str], title: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("gpu_length_report: no matplotlib: no PNG", file=sys.stderr)
        return None
    if not rows:
        return None
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for i, m in enumerate(methods):  # one colour a method in both panels
        pts = [(r["tokens_per_param"], r["loss"][m]) for r in rows if m in r["loss"]]
        if pts:
            ax[0].plot(*zip(*pts), marker="o", color=f"C{i}", label=label(m))
        g = [(r["tokens_per_param"], r["gaps"][m][0]) for r in rows if m in r["gaps"]]
        if g:
            ax[1].plot(*zip(*g), marker="o", color=f"C{i}", label=label(m))
    for a in ax:
        a.set_xscale("log")
        a.set_xlabel("training tokens per parameter")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    ax[0].set_ylabel("final validation loss (nats/token)")
    ax[1].set_ylabel("gap to dense AdamS (%)")
    ax[1].axhline(0, color="grey", lw=0.8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    p = os.path.join(out, "length_gap.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def markdown(out: str, runs: List[Dict[str, Any]], plan: Dict[str, Any], meta: Dict[str, Any],
             base: Optional[Dict[str, float]], why_no_base: str, dry: bool) -> str:
    methods = plan.get("methods") or sorted({r["method"] for r in runs})
    L: List[str] = ["## The gap against training length on one GPU "
                    "(`perf/gpu/gpu_train.sh length`)", ""]
    if dry:
        L += ["**DRY RUN on the CPU (tiny model, gloo/UCX, 2 ranks): checks that the script runs "
              "and writes its outputs. Not a measurement.**", ""]
    env = next((r.get("env") for r in runs if r.get("env")), {}) or {}
    facts = [("date", env.get("date")), ("GPU", env.get("gpu")),
             ("GPU memory (GiB)", env.get("gpu_memory_gib")), ("NCCL", env.get("nccl")),
             ("python", env.get("python")), ("torch", env.get("torch")),
             ("scape", env.get("scape")), ("library", env.get("scape_library")),
             ("SCAPE communicator backend", env.get("scape_backend"))]
    facts += [(k, v) for k, v in meta.items() if k != "command"]
    L += [f"- {k}: {v}" for k, v in facts if v not in (None, "")]
    if meta.get("command"):
        L += ["", "```", str(meta["command"]), "```"]
    L.append("")
    r0 = runs[0] if runs else None
    if r0:
        sh = r0["shape"]
        lr = plan.get("lr") or {}
        lrs = ", ".join(f"{label(m)} {x:g}" for m, x in lr.items())
        why_lr = "not swept at this size"
        if any(lr.get(m) == 2 * lr.get(DENSE, 0) for m in lr if m.startswith("scape")):
            why_lr += ("; SCAPE at twice dense AdamS's, the ratio of the CPU study's best lrs at "
                       "0.12M parameters")
        opts = "; ".join(f"{label(m)}: {gpu_opts(m)}" for m in methods if m.startswith("scape"))
        L.append(
            f"Set-up: perf/train/model.py's GPT of {r0['params']:,} parameters ({sh['n_layers']} "
            f"block{'s' if sh['n_layers'] != 1 else ''}, d_model {sh['d_model']}, context "
            f"{sh['context']}), {r0['dtype']} with "
            f"{r0['master_weights']} master weights, {r0['env'].get('world_size')} ranks as "
            f"processes on one device, {sh['batch']} sequences of {sh['context']} tokens a rank: "
            f"{plan.get('tokens_per_step', 0):,} tokens a step at every length, seed {r0['seed']}. "
            f"Each length is its own run of every method, with its own lr schedule ending at its "
            f"length (linear warm-up over 5% of the steps, cosine to 10% of the peak); betas "
            f"{tuple(r0['betas'])}, weight decay {r0['weight_decay']}, clipping at {r0['clip']} "
            f"(SCAPE: the recovered gradient). Peak lr: {lrs} ({why_lr}). SCAPE: density "
            f"warm-up over the first 10% of the steps, bf16 payloads; dense AdamS through the "
            f"library, every tensor dense, fp32 payload. Options: {opts or '-'}.")
        c = r0.get("corpus", {})
        L += ["", f"Corpus: Debian's `{c.get('package')}` {c.get('version')} "
                  f"({c.get('documents')} documents, {c.get('train_bytes')} training bytes; "
                  f"sha256 {str(c.get('sha256'))[:16]}...)."]
    L.append("")
    if base:
        L.append(f"Corpus baselines (validation, nats per token): unigram {base['unigram']:.3f}, "
                 f"bigram {base['bigram']:.3f}; a loss within {qs.NEAR} nats of either is flagged "
                 f"[... plateau].")
    else:
        L.append(f"Corpus baselines: not available ({why_no_base}); no plateau flags.")
    L.append("")
    rows: List[Dict[str, Any]] = []
    if runs:
        L.append("Final validation loss (nats per token), the gap to dense AdamS at the same "
                 "length in % and in nats, and the dense-step equivalent (the dense AdamS step "
                 "whose evaluation curve reaches the same loss):")
        L.append("")
        table, rows = length_table(runs, methods, base)
        L += table
        L += ["", "Step time and bytes (over each method's runs):", ""]
        L += speed_table(runs, methods, plan.get("lr") or {})
    else:
        L.append("No run finished (see the log).")
    L.append("")
    ran = {r["tokens_per_param_requested"] for r in runs}
    for d in plan.get("plan", []):
        if d["status"] == "skipped" or d["requested"] not in ran:
            what = d["status"] if d["status"] == "skipped" else f"{d['status']}, not run"
            L.append(f"- {d['requested']:g} tokens per parameter: {what}"
                     f"{': ' + d['why'] if d['why'] else ''}.")
        elif d["status"] == "shrunk":
            L.append(f"- {d['requested']:g} tokens per parameter: shrunk to "
                     f"{d['tokens_per_param']:.3g} ({d['steps']} steps): {d['why']}.")
    est = plan.get("estimates") or {}
    if est.get("step_seconds"):
        L.append("- The plan's estimates (from the first run's first steps, then each finished "
                 "run): step " + ", ".join(f"{label(m)} {1e3 * t:.1f} ms" for m, t in
                                             est["step_seconds"].items())
                 + f"; evaluation {est.get('eval_seconds', 0):.2f} s, run set-up "
                   f"{est.get('setup_seconds', 0):.2f} s.")
    trunc = [f"{label(r['method'])} at {r['tokens_per_param_planned']:.3g}" for r in runs
             if r.get("truncated")]
    if trunc:
        L.append(f"- Truncated by their deadline (fewer tokens, not comparable): "
                 f"{', '.join(trunc)}.")
    if r0:
        L.append(f"- Hashes compared at every evaluation: the fp32 master weights "
                 f"({r0.get('hash_kind')}) and the model's parameters.")
        L += ["", "![final loss and gap against training length](length_gap.png)"]
    for k in ("not_run", "failed"):
        if meta.get(k):
            L += ["", f"{'Not run' if k == 'not_run' else 'Failed'}: {meta[k]} (see the log)."]
    text = "\n".join(L) + "\n"
    with open(os.path.join(out, "gpu_length.md"), "w") as f:
        f.write(text)
    plot(out, rows, methods, "DRY RUN (CPU)" if dry else (env.get("gpu") or "GPU"))
    return text


def gpu_opts(method: str) -> str:
    """What gpu_train.py passes for a configuration's options (its variant)."""
    parts = method.split("-", 2)
    if len(parts) < 3:
        return "the paper's defaults"
    keys = {"segment_rms": 'entering="segment_rms"', "clipstay": 'clip_norm="staying"',
            "artifact": 'bias_correction="artifact"'}
    return ", ".join(keys.get(v, v) for v in parts[2].split("+"))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--meta", default="")
    ap.add_argument("--corpus", default="", help="the corpus folder the runs read (bundled)")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    runs = read_jsonl(os.path.join(a.out, "length_runs.jsonl"))
    plan: Dict[str, Any] = {}
    p = os.path.join(a.out, "length_plan.json")
    if os.path.exists(p):
        with open(p) as f:
            plan = json.load(f)
    meta: Dict[str, Any] = {}
    if a.meta and os.path.exists(a.meta):
        with open(a.meta) as f:
            meta = json.load(f)
    base, why = baselines(a.corpus)
    print(markdown(a.out, runs, plan, meta, base, why, a.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
