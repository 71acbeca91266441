"""The figures of perf/gpu/gpu_train.sh: reads OUT/step_bench.jsonl and OUT/train_runs.jsonl and
writes OUT/train_loss.png (validation loss against step and against bytes sent per rank),
OUT/step_bench.png (step time by row, split into the library's phases) and OUT/gpu_train.md (a
Markdown section ready to paste into perf/RESULTS_gpu.md, with the targets and verdicts).

    python3 perf/gpu/gpu_report.py --out DIR [--meta DIR/meta.json] [--dry-run]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

PHASES = ("sync_wait", "candidate", "select", "exchange", "norm", "update", "gather")
STEP_TARGET = 3.0    # SCAPE step at 0.01 vs the dense AdamS step
TRAIN_TARGET = 1.5   # training tokens/s at 0.01 vs dense AdamS


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def fmt(x: Optional[float], spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


DRY = False


def verdict(ratio: Optional[float], target: float) -> str:
    if ratio is None:
        return "not measured"
    if DRY:
        return f"{ratio:.2f}x (dry run on the CPU: no verdict)"
    met = "**meets** the target" if ratio >= target else "**misses** the target"
    return f"{ratio:.2f}x: {met}"


def plots(out: str, runs: List[Dict[str, Any]], steps: List[Dict[str, Any]],
          title: str) -> List[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("gpu_report: no matplotlib: no PNG", file=sys.stderr)
        return []
    made = []
    if runs:
        fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in runs:
            c = r["curve"]
            lab = f"{r['config']} ({fmt(r.get('tokens_per_second'), '.0f')} tok/s)"
            ax[0].plot([p["step"] for p in c], [p["val_loss"] for p in c], marker="o", ms=3,
                       label=lab)
            c1 = [p for p in c if p["bytes_sent"] > 0]  # log axis: from the first bytes on
            ax[1].plot([p["bytes_sent"] for p in c1], [p["val_loss"] for p in c1], marker="o",
                       ms=3, label=r["config"])
        ax[0].set_xlabel("step")
        ax[0].set_ylabel("validation loss (nats/byte)")
        ax[1].set_xlabel("bytes sent per rank (cumulative; DDP: ring estimate)")
        ax[1].set_xscale("log")
        ax[0].legend(fontsize=8)
        ax[1].legend(fontsize=8)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        p = os.path.join(out, "train_loss.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)
    done = [s for s in steps if s.get("step_ms_median") is not None]
    if done:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        names = [s["row"] for s in done]
        bottom = [0.0] * len(done)
        for ph in PHASES:
            vals = [s.get("phases_ms", {}).get(ph, 0.0) for s in done]
            if any(vals):
                ax.bar(names, vals, bottom=bottom, label=ph)
                bottom = [b + v for b, v in zip(bottom, vals)]
        rest = [max(0.0, s["step_ms_median"] - b) for s, b in zip(done, bottom)]
        ax.bar(names, rest, bottom=bottom, label="other (outside the phases)", color="#cccccc")
        ax.set_ylabel("step time (ms, median of the slowest rank)")
        ax.legend(fontsize=8)
        ax.set_title(f"{title}: the step, {done[0]['params'] / 2**20:g} Mi parameters", fontsize=10)
        fig.tight_layout()
        p = os.path.join(out, "step_bench.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)
    return made


def markdown(out: str, runs: List[Dict[str, Any]], steps: List[Dict[str, Any]],
             meta: Dict[str, Any], dry: bool) -> str:
    env = next((x.get("env") for x in steps + runs if x.get("env")), {}) or {}
    L: List[str] = []
    L.append("## End-to-end training and the step on device (perf/gpu/gpu_train.sh)")
    L.append("")
    if dry:
        L.append("**DRY RUN on the CPU (tiny sizes, gloo/UCX): checks that the script runs and "
                 "writes its outputs. Not a measurement.**")
        L.append("")
    facts = [("date", env.get("date")), ("GPU", env.get("gpu")),
             ("GPU memory (GiB)", env.get("gpu_memory_gib")), ("NCCL", env.get("nccl")),
             ("python", env.get("python")), ("torch", env.get("torch")),
             ("scape", env.get("scape")), ("library", env.get("scape_library")),
             ("SCAPE communicator backend", env.get("scape_backend"))]
    facts += [(k, v) for k, v in meta.items() if k not in ("command",)]
    for k, v in facts:
        if v not in (None, ""):
            L.append(f"- {k}: {v}")
    if meta.get("command"):
        L.append("")
        L.append("```")
        L.append(str(meta["command"]))
        L.append("```")

    # -- the step ----------------------------------------------------------------------------
    L.append("")
    by = {s["row"]: s for s in steps}
    dense = by.get("adams-dense", {}).get("step_ms_median")
    n = next((s["params"] for s in steps if s.get("params")), None)
    L.append(f"### The optimizer step on device (perf/gpu/gpu_step.py), "
             f"{n / 2**20:g} Mi fp32 parameters, {env.get('world_size', '?')} ranks"
             if n else "### The optimizer step on device (perf/gpu/gpu_step.py)")
    L.append("")
    if steps:
        L.append("| row | optimizer | density | payload | step ms (median) | dense AdamS / row | "
                 + " | ".join(PHASES)
                 + " | bytes sent/step/rank | peak GiB/rank | ranks identical |")
        L.append("|" + "---|" * (9 + len(PHASES)))
        for s in steps:
            if s.get("skipped"):
                L.append(f"| {s['row']} | skipped: {s['skipped']} |" + " |" * (7 + len(PHASES)))
                continue
            ms = s.get("step_ms_median")
            sp = dense / ms if dense and ms else None
            ph = " | ".join(fmt(s.get("phases_ms", {}).get(p)) for p in PHASES)
            mem = s.get("max_memory_allocated")
            L.append(f"| {s['row']} | {s['optimizer']} | {s['density']:g} | {s['payload']} | "
                     f"{fmt(ms)} | {fmt(sp)} | {ph} | "
                     f"{fmt(s.get('bytes_sent_per_step'), ',.0f')} | "
                     f"{fmt(mem / 2**30 if mem else None, '.1f')} | "
                     f"{'yes' if s.get('ranks_identical') else 'NO'} |")
        s01 = by.get("scape-0.01", {}).get("step_ms_median")
        L.append("")
        L.append(f"- Target, the SCAPE step at density 0.01 >= {STEP_TARGET:g}x faster than the "
                 f"dense AdamS step: "
                 f"{verdict(dense / s01 if dense and s01 else None, STEP_TARGET)}")
        L.append("- Phases are rank 0's means (ScapeAdamS.info()); 'adamw' lists its all-reduce "
                 "as the exchange. The dense AdamS row is the library's step with every tensor "
                 "dense (no top-k).")
    else:
        L.append("No step figures (the step benchmark did not run or failed: see the log).")

    # -- training ----------------------------------------------------------------------------
    L.append("")
    r0 = runs[0] if runs else None
    if r0:
        sh = r0["shape"]
        L.append(f"### Training: GPT of {r0['params']:,} parameters "
                 f"({sh['n_layers']} blocks, d_model {sh['d_model']}, context {sh['context']}), "
                 f"{r0['dtype']} with {r0['master_weights']} master weights, "
                 f"{r0['env'].get('world_size')} ranks x {sh['batch']} sequences, "
                 f"{sh['steps']} steps, seed {r0['seed']}")
        c = r0.get("corpus", {})
        L.append("")
        L.append(f"Corpus: Debian's `{c.get('package')}` {c.get('version')} "
                 f"({c.get('documents')} documents, {c.get('train_bytes')} training bytes; "
                 f"sha256 {str(c.get('sha256'))[:16]}...).")
        L.append("")
        L.append("| configuration | payload | lr | steps run | tokens | final val loss | "
                 "tokens/s | "
                 "tokens/s vs dense AdamS | step ms (median) | "
                 + " | ".join(PHASES) + " | bytes sent/step/rank | ranks identical at every eval |")
        L.append("|" + "---|" * (11 + len(PHASES)))
        base = next((r for r in runs if r["config"] == "adams"), None)
        btps = base.get("tokens_per_second") if base else None
        for r in runs:
            tps = r.get("tokens_per_second")
            ph = " | ".join(fmt(r.get("phases_ms_mean", {}).get(p)) for p in PHASES)
            steps_run = f"{r['steps_done']}" + (" (truncated)" if r.get("truncated") else "")
            L.append(f"| {r['config']} | {r['payload']} | {r['lr']:g} | {steps_run} | "
                     f"{r['tokens']:,} | {r['final_val_loss']:.4f} | {fmt(tps, ',.0f')} | "
                     f"{fmt(tps / btps if tps and btps else None)} | "
                     f"{fmt(r.get('step_ms_median'))} | {ph} | "
                     f"{fmt(r.get('bytes_per_step'), ',.0f')} | "
                     f"{'yes' if r['ranks_identical'] else 'NO'} |")
        s01 = next((r for r in runs if r["config"] == "scape-0.01"), None)
        tps01 = s01.get("tokens_per_second") if s01 else None
        tr = tps01 / btps if tps01 and btps else None
        L.append("")
        L.append(f"- Target, training tokens/s at density 0.01 >= {TRAIN_TARGET:g}x dense "
                 f"AdamS's: {verdict(tr, TRAIN_TARGET)}")
        trunc = [r["config"] for r in runs if r.get("truncated")]
        if trunc:
            L.append(f"- Truncated by the time budget (fewer tokens than the others): "
                     f"{', '.join(trunc)}; their losses are not comparable.")
        L.append(f"- Hashes compared at every evaluation: the fp32 master weights "
                 f"({r0.get('hash_kind')} for {r0['config']}) and the model's parameters.")
        L.append("- DDP's bytes are the ring estimate 2(P-1)/P x gradient bytes; the library's "
                 "are what it sent (mask + payload + dense parts).")
        L.append("")
        L.append("![validation loss against step and bytes sent](train_loss.png)")
    else:
        L.append("No training figures (the runs did not run or failed: see the log).")
    missing = meta.get("not_run")
    if missing:
        L.append("")
        L.append(f"Not run or failed: {missing} (see the log).")
    text = "\n".join(L) + "\n"
    with open(os.path.join(out, "gpu_train.md"), "w") as f:
        f.write(text)
    return text


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--meta", default="")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    runs = read_jsonl(os.path.join(a.out, "train_runs.jsonl"))
    steps = read_jsonl(os.path.join(a.out, "step_bench.jsonl"))
    global DRY
    DRY = a.dry_run
    meta: Dict[str, Any] = {}
    if a.meta and os.path.exists(a.meta):
        with open(a.meta) as f:
            meta = json.load(f)
    title = "DRY RUN (CPU)" if a.dry_run else (
        next((x["env"].get("gpu") for x in steps + runs if x.get("env")), None) or "GPU")
    plots(a.out, runs, steps, title)
    print(markdown(a.out, runs, steps, meta, a.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
