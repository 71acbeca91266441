"""Turns a training job's output (OUT/runs.jsonl, OUT/meta.json from train.py) into
OUT/val_loss.png (validation-loss curves, mean over seeds, min-max band) and OUT/table.md
(final validation loss with its seed spread, tokens per second, bytes sent per step, average
density, ranks bit-identical at every evaluation). With --results FILE it also replaces the
part of FILE between the markers "<!-- BEGIN generated -->" and "<!-- END generated -->".

    /usr/bin/python3 perf/train/summarize.py perf/train/out [--results perf/RESULTS_training.md]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import OrderedDict
from typing import Any, Dict, List

import numpy as np

BEGIN, END = "<!-- BEGIN generated -->", "<!-- END generated -->"


def load(out: str):
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    runs = []
    with open(os.path.join(out, "runs.jsonl")) as f:
        for line in f:
            if line.strip():
                runs.append(json.loads(line))
    return meta, runs


def groups(runs: List[Dict[str, Any]]) -> "OrderedDict[str, List[Dict[str, Any]]]":
    g: "OrderedDict[str, List[Dict[str, Any]]]" = OrderedDict()
    for r in runs:
        g.setdefault(r["group"], []).append(r)
    return g


def label(r: Dict[str, Any]) -> str:
    opt = {"adamw": "AdamW + gloo all-reduce", "adams": "dense AdamS (scape)",
           "scape": "SCAPE", "topk": "top-k + EF (sparse all-reduce)"}[r["opt"]]
    if r["opt"] in ("scape", "topk"):
        opt += f" density {r['density']:g}"
    if r["payload"] != "float32":
        opt += f" {r['payload']}"
    if r["opt"] == "scape":
        opt += f" warm-up {r['warmup_frac']:g}"
    return opt


def table(meta: Dict[str, Any], runs: List[Dict[str, Any]]) -> str:
    best = meta.get("best_lr", {})
    lines = [
        "| configuration | phase | steps | peak lr | seeds | final val loss (mean, min-max) "
        "| tokens/s | bytes sent/step/rank | avg density | avg fraction sent | ranks identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rs in groups(runs).items():
        v = np.array([r["final_val_loss"] for r in rs])
        tps = np.mean([r["tokens_per_second"] for r in rs])
        b = np.mean([r["bytes_per_step"] for r in rs])
        d = np.mean([r["avg_density"] for r in rs])
        fr = np.mean([r.get("avg_sent_fraction", r["avg_density"]) for r in rs])
        ident = all(r["ranks_identical"] for r in rs)
        r0 = rs[0]
        mark = ""
        if r0["phase"] == 1 and best.get(r0["opt"]) == r0["lr"]:
            mark = " (best)"
        lines.append(
            f"| {label(r0)} `{name}` | {r0['phase']} | {r0['steps']} | {r0['lr']:g}{mark} "
            f"| {len(rs)} | {v.mean():.4f} ({v.min():.4f}-{v.max():.4f}) | {tps:.0f} "
            f"| {b:,.0f} | {d:.4f} | {fr:.4f} | {'yes' if ident else 'NO'} |")
    return "\n".join(lines)


def run_table(runs: List[Dict[str, Any]]) -> str:
    """One line per run: its loss next to its own average density and bytes."""
    lines = ["| run | seed | steps | peak lr | final val loss | avg density | avg fraction sent "
             "| bytes sent/step/rank | tokens/s | ranks identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(
            f"| `{r['group']}` | {r['seed']} | {r['steps']} | {r['lr']:g} "
            f"| {r['final_val_loss']:.4f} | {r['avg_density']:.4f} "
            f"| {r.get('avg_sent_fraction', r['avg_density']):.4f} | {r['bytes_per_step']:,.0f} "
            f"| {r['tokens_per_second']:.0f} | {'yes' if r['ranks_identical'] else 'NO'} |")
    return "\n".join(lines)


def plot(meta: Dict[str, Any], runs: List[Dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = groups(runs)
    panels = [("learning-rate sweep (phase 1)", lambda r: r["phase"] == 1),
              ("N steps (with the sweep's best AdamW and AdamS)",
               lambda r: (r["phase"] == 2 and r["steps"] == min(x["steps"] for x in runs))
               or (r["phase"] == 1 and meta.get("best_lr", {}).get(r["opt"]) == r["lr"])),
              ("4N steps", lambda r: r["phase"] == 2 and r["steps"] > min(
                  x["steps"] for x in runs))]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    for ax, (title, sel) in zip(axes, panels):
        for name, rs in g.items():
            if not sel(rs[0]):
                continue
            steps = [c["tokens"] for c in rs[0]["curve"]]
            vals = np.array([[c["val_loss"] for c in r["curve"]] for r in rs])
            lab = f"{name} (lr {rs[0]['lr']:g})"
            line, = ax.plot(steps, vals.mean(0), label=lab)
            if len(rs) > 1:
                ax.fill_between(steps, vals.min(0), vals.max(0), alpha=0.2,
                                color=line.get_color())
        ax.set_title(title)
        ax.set_xlabel("training tokens (all ranks)")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    c = meta["corpus"]
    fig.suptitle(f"byte-level GPT on Debian {c['package']} {c['version']}, "
                 f"{meta['world_size']} ranks, plan {meta['plan']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(meta: Dict[str, Any], runs: List[Dict[str, Any]], out: str) -> str:
    c, m, s = meta["corpus"], meta["machine"], meta["shape"]
    n_params = runs[0]["params"] if runs else 0
    return "\n".join([
        f"Plan `{meta['plan']}`, {meta['world_size']} ranks, job time "
        f"{meta.get('job_seconds', float('nan')):.0f} s. Machine: {m['cpu']}, {m['cores']} cores; "
        f"Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}, BLAS {m['blas']}; "
        f"scape {m['scape_version']} at commit {m['git']}.",
        "",
        f"Text: Debian package `{c['package']}` {c['version']}, {c['files']} databases, "
        f"SHA-256 {c['sha256']}; {c['documents']} documents, {c['train_documents']} train / "
        f"{c['val_documents']} validation (split by document), {c['train_bytes']:,} / "
        f"{c['val_bytes']:,} bytes.",
        "",
        f"Model: {s['n_layers']} layers, d_model {s['d_model']}, {s['n_heads']} heads, context "
        f"{s['context']}, {n_params:,} parameters; {s['batch']} sequences per rank per step; "
        f"validation every {s['eval_every']} steps on {s['eval_windows']} windows. Best peak lr "
        f"(phase 1): {meta.get('best_lr')}.",
        "",
        table(meta, runs),
        "",
        "Every run (average density and bytes over the whole run, next to its loss):",
        "",
        run_table(runs),
        "",
        f"Curves: `{os.path.join(out, 'val_loss.png')}`.",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--results", help="markdown file whose generated section to replace")
    a = ap.parse_args()
    meta, runs = load(a.out)
    if not runs:
        print("summarize: no runs", file=sys.stderr)
        return 1
    text = report(meta, runs, a.out)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(text + "\n")
    plot(meta, runs, os.path.join(a.out, "val_loss.png"))
    print(text)
    if a.results:
        with open(a.results) as f:
            doc = f.read()
        if BEGIN not in doc or END not in doc:
            print(f"summarize: {a.results} has no generated section", file=sys.stderr)
            return 1
        head, rest = doc.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        with open(a.results, "w") as f:
            f.write(head + BEGIN + "\n" + text + "\n" + END + tail)
    bad = [r["name"] for r in runs if not r["ranks_identical"]]
    if bad:
        print(f"summarize: ranks diverged in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
