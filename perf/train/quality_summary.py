"""Tables of the quality study of issue 30 (perf/train/scaling.py --plan q20 and later plans)
from OUT/runs.jsonl, with what every number needs beside it:

  - the corpus's unigram and bigram cross-entropies (fit on the training documents, measured
    on the validation documents, in nats per token, the same tokens the model sees), and a flag
    on every loss within 0.05 nats of either: a run there has learned no more than that model;
  - per run: the final validation loss, its gap to dense AdamS at the same size and length
    (the mean over dense AdamS's seeds at its best lr) in % and in nats, and the dense-step
    equivalent: how many dense AdamS steps reach the same loss (linear interpolation on dense
    AdamS's evaluation curve; "> N" when dense never gets that low... or the loss is above
    dense's first evaluation after step 0);
  - the learning-rate sweep per method, its best point, and whether the best is interior.

    python3 perf/train/quality_summary.py perf/train/out-quality            # print
    python3 perf/train/quality_summary.py perf/train/out-quality --md FILE  # also write FILE

Nothing here trains; it reads what the study recorded.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import data  # noqa: E402

NEAR = 0.05  # nats: "on the plateau" of the unigram / bigram model


def ngram_baselines(corpus: Optional[data.Corpus] = None) -> Dict[str, float]:
    """Cross-entropy (nats per token) on the validation documents of the unigram and bigram
    models fit on the training documents (add-one smoothing over the 257-token vocabulary),
    over the tokens a model predicts (every token after the first of the stream)."""
    c = corpus or data.load()
    tr, va = data.encode(c.train_docs), data.encode(c.val_docs)
    V = data.VOCAB
    uni = np.bincount(tr, minlength=V).astype(np.float64) + 1.0
    uni /= uni.sum()
    big = np.ones((V, V), dtype=np.float64)
    np.add.at(big, (tr[:-1], tr[1:]), 1.0)
    big /= big.sum(axis=1, keepdims=True)
    x, y = va[:-1], va[1:]
    return {"unigram": float(-np.log(uni[y]).mean()),
            "bigram": float(-np.log(big[x, y]).mean())}


def flag(loss: float, base: Dict[str, float]) -> str:
    near = [k for k, v in base.items() if abs(loss - v) <= NEAR]
    return f" [{'/'.join(near)} plateau]" if near else ""


def read(out: str) -> List[Dict[str, Any]]:
    rows = []
    with open(os.path.join(out, "runs.jsonl")) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    return rows


def dense_steps_to(curve: List[Dict[str, Any]], loss: float) -> Tuple[Optional[float], str]:
    """Steps dense AdamS needs to reach `loss`, interpolated on its evaluation curve."""
    pts = [(c["step"], c["val_loss"]) for c in curve]
    for (s0, l0), (s1, l1) in zip(pts, pts[1:]):
        if l1 <= loss <= l0 or l0 <= loss <= l1:
            if l1 == l0:
                return float(s0), f"{s0}"
            s = s0 + (loss - l0) / (l1 - l0) * (s1 - s0)
            return s, f"{s:.0f}"
    if loss < min(v for _, v in pts):
        return None, f"> {pts[-1][0]}"
    return None, "?"


def sweep_table(rows: List[Dict[str, Any]], base: Dict[str, float]) -> Tuple[str, Dict]:
    by = defaultdict(list)
    for r in rows:
        if r.get("stage") == "sweep":
            by[(r["size"], r["tokens_per_param"], r["group"])].append(r)
    lines = ["| size | tokens/param | method | lr: final val loss (nats) | best lr | interior |",
             "|---|---|---|---|---|---|"]
    best: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for (size, tpp, g), rs in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        rs = sorted(rs, key=lambda r: r["lr"])
        b = min(rs, key=lambda r: r["final_val_loss"])
        best[(size, g)] = b
        interior = "yes" if len(rs) >= 3 and rs[0] is not b and rs[-1] is not b else "no (edge)"
        pts = ", ".join(f"{r['lr']:g}: {r['final_val_loss']:.3f}{flag(r['final_val_loss'], base)}"
                        for r in rs)
        lines.append(f"| {rs[0]['size_label']} | {tpp:.0f} | {g} | {pts} | {b['lr']:g} | "
                     f"{interior} ({len(rs)} points) |")
    return "\n".join(lines), best


def gap_table(rows: List[Dict[str, Any]], best: Dict, base_ce: Dict[str, float]) -> str:
    """Every configuration at its best lr (all seeds run there) against dense AdamS."""
    lines = ["| size | method | lr | seeds | final val loss (mean ± spread) | gap to dense AdamS "
             "| dense-step equivalent (of N) | option vs its method, same seeds | bytes/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups = sorted({(r["size"], r["group"]) for r in rows})
    for size, g in groups:
        ref = best.get((size, "adams"))
        note = ""
        if (size, g) in best:
            lr = best[(size, g)]["lr"]
        else:  # a variant or peer: its lr with the lowest mean (seed 1 where lrs were tried)
            at = defaultdict(list)
            for r in rows:
                if r["size"] == size and r["group"] == g:
                    at[r["lr"]].append(r["final_val_loss"])
            lr = min(at, key=lambda x: (float(np.mean(at[x])), x))
            if len(at) > 1:
                note = " (best of " + ", ".join(f"{x:g}: {np.mean(v):.3f}" for x, v in
                                                 sorted(at.items())) + ")"
        rs = [r for r in rows if r["size"] == size and r["group"] == g and r["lr"] == lr]
        v = np.array([r["final_val_loss"] for r in rs])
        gap = "n/a"
        equiv = "n/a"
        if ref is not None:
            dense = [r for r in rows if r["size"] == size and r["group"] == "adams"
                     and r["lr"] == ref["lr"]]
            dv = float(np.mean([r["final_val_loss"] for r in dense]))
            d = float(v.mean()) - dv
            gap = f"{100 * d / dv:+.1f}% ({d:+.3f} nats)"
            steps, txt = dense_steps_to(ref["curve"], float(v.mean()))
            equiv = f"{txt} of {rs[0]['steps']}"
        spread = f" ± {(v.max() - v.min()) / 2:.3f}" if len(v) > 1 else ""
        # an option (scape-0.1-segrms, ...) against its method at the method's best lr, over
        # the seeds both ran: seeds differ by more than the options do
        same = ""
        base = next((b for b in ("scape-0.01", "scape-0.1") if g.startswith(b + "-")), None)
        if base and (size, base) in best:
            blr = best[(size, base)]["lr"]
            bs = {r["seed"]: r["final_val_loss"] for r in rows if r["size"] == size
                  and r["group"] == base and r["lr"] == blr}
            common = [r for r in rs if r["seed"] in bs]
            if common:
                d = float(np.mean([r["final_val_loss"] - bs[r["seed"]] for r in common]))
                same = f"{d:+.3f} nats ({len(common)} seed{'s' if len(common) > 1 else ''})"
        lines.append(f"| {rs[0]['size_label']} | {g} | {lr:g}{note} | {len(rs)} | {v.mean():.3f}"
                     f"{spread}{flag(float(v.mean()), base_ce)} | {gap} | {equiv} | {same} | "
                     f"{np.mean([r['bytes_per_step'] for r in rs]):,.0f} |")
    return "\n".join(lines)


def report(out: str) -> str:
    rows = read(out)
    base = ngram_baselines()
    sweep, best = sweep_table(rows, base)
    return "\n\n".join([
        f"Corpus baselines (validation, nats per token): unigram {base['unigram']:.3f}, bigram "
        f"{base['bigram']:.3f}; a loss within {NEAR} nats of either is flagged "
        f"[... plateau].",
        "Learning-rate sweeps (seed 1):", sweep,
        "Each method at its best lr, against dense AdamS at its best lr:",
        gap_table(rows, best, base),
        f"{len(rows)} runs in {out}/runs.jsonl."])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--md", help="also write the report to this file")
    a = ap.parse_args()
    text = report(a.out)
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
