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
    models fit on the training documents (data.ngram_baselines)."""
    return data.ngram_baselines(corpus or data.load())


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


def lr_of(rows: List[Dict[str, Any]], best: Dict, size: str, tpp: float,
          g: str) -> Tuple[Optional[float], str]:
    """The lr a configuration is reported at, at one size and length: its sweep's best lr
    where it ran there (the axes run at q20's), else the lr of the lowest mean over what it
    ran (an option tried at several lrs), with those tried."""
    at: Dict[float, Dict[int, float]] = defaultdict(dict)
    for r in rows:
        if r["size"] == size and r["tokens_per_param"] == tpp and r["group"] == g:
            at[r["lr"]][r["seed"]] = r["final_val_loss"]
    if not at:
        return None, ""
    if (size, g) in best and best[(size, g)]["lr"] in at:
        return best[(size, g)]["lr"], ""
    # chosen on the seeds every lr ran (seed 1, the screen's), so that a second seed run at
    # one lr only does not move the choice
    common = set.intersection(*(set(v) for v in at.values()))

    def score(x: float) -> float:
        v = at[x]
        return float(np.mean([v[k] for k in common] if common else list(v.values())))

    lr = min(at, key=lambda x: (score(x), x))
    note = ""
    if len(at) > 1:
        note = (" (chosen on seed" + ("s " if len(common) > 1 else " ") +
                ", ".join(str(k) for k in sorted(common)) + " of " +
                ", ".join(f"{x:g}: {score(x):.3f}" for x in sorted(at)) + ")")
    return lr, note


def at_lr(rows: List[Dict[str, Any]], size: str, tpp: float, g: str,
          lr: Optional[float]) -> List[Dict[str, Any]]:
    return [r for r in rows if r["size"] == size and r["tokens_per_param"] == tpp and
            r["group"] == g and r["lr"] == lr]


def gap_table(rows: List[Dict[str, Any]], best: Dict, base_ce: Dict[str, float]) -> str:
    """Every configuration at its best lr (all seeds run there) against dense AdamS at the
    same size and length."""
    lines = ["| size | tokens/param | method | lr | seeds | final val loss (mean ± spread) | gap "
             "to dense AdamS | dense-step equivalent (of N) | option vs its method, same seeds "
             "| bytes/step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups = sorted({(r["size"], r["tokens_per_param"], r["group"]) for r in rows})
    for size, tpp, g in groups:
        lr, note = lr_of(rows, best, size, tpp, g)
        rs = at_lr(rows, size, tpp, g, lr)
        v = np.array([r["final_val_loss"] for r in rs])
        gap = "n/a"
        equiv = "n/a"
        dlr, _ = lr_of(rows, best, size, tpp, "adams")
        dense = at_lr(rows, size, tpp, "adams", dlr)
        if dense:
            dv = float(np.mean([r["final_val_loss"] for r in dense]))
            d = float(v.mean()) - dv
            gap = f"{100 * d / dv:+.1f}% ({d:+.3f} nats)"
            ref = min(dense, key=lambda r: r["seed"])
            steps, txt = dense_steps_to(ref["curve"], float(v.mean()))
            equiv = f"{txt} of {rs[0]['steps']}"
        spread = f" ± {(v.max() - v.min()) / 2:.3f}" if len(v) > 1 else ""
        # an option (scape-0.1-segrms, ...) against its method at the method's lr, over the
        # seeds both ran: seeds differ by more than the options do
        same = ""
        base = next((b for b in ("scape-0.01", "scape-0.1") if g.startswith(b + "-")), None)
        if base:
            blr, _ = lr_of(rows, best, size, tpp, base)
            bs = {r["seed"]: r["final_val_loss"] for r in at_lr(rows, size, tpp, base, blr)}
            common = [r for r in rs if r["seed"] in bs]
            if common:
                d = float(np.mean([r["final_val_loss"] - bs[r["seed"]] for r in common]))
                same = f"{d:+.3f} nats ({len(common)} seed{'s' if len(common) > 1 else ''})"
        lines.append(f"| {rs[0]['size_label']} | {tpp:.3g} | {g} | {lr:g}{note} | {len(rs)} | "
                     f"{v.mean():.3f}{spread}{flag(float(v.mean()), base_ce)} | {gap} | {equiv} "
                     f"| {same} | {np.mean([r['bytes_per_step'] for r in rs]):,.0f} |")
    return "\n".join(lines)


AXIS_METHODS = ["scape-0.1", "scape-0.01"]


AxisPoint = Tuple[float, str, float, float, int, float, float]


def axes(rows: List[Dict[str, Any]], best: Dict) -> Dict[str, List[AxisPoint]]:
    """The gap of each SCAPE density (and of every option run on an axis) to dense AdamS, per
    (size, tokens/param): {method: [(x, size, tokens/param, gap %, seeds, lowest seed's gap %,
    highest seed's gap %)]}, x being tokens per parameter (the length axis, one size) or
    parameters (the size axis); a seed's gap is to dense AdamS's mean."""
    out: Dict[str, List[AxisPoint]] = defaultdict(list)
    points = sorted({(r["size"], r["tokens_per_param"]) for r in rows})
    for size, tpp in points:
        dlr, _ = lr_of(rows, best, size, tpp, "adams")
        dense = at_lr(rows, size, tpp, "adams", dlr)
        if not dense:
            continue
        dv = float(np.mean([r["final_val_loss"] for r in dense]))
        for g in sorted({r["group"] for r in rows if r["size"] == size and
                         r["tokens_per_param"] == tpp and r["group"].startswith("scape-")}):
            lr, _ = lr_of(rows, best, size, tpp, g)
            rs = at_lr(rows, size, tpp, g, lr)
            ls = [r["final_val_loss"] for r in rs]
            v = float(np.mean(ls))
            out[g].append((float(rs[0]["params"]), size, tpp, 100 * (v - dv) / dv, len(rs),
                           100 * (min(ls) - dv) / dv, 100 * (max(ls) - dv) / dv))
    return out


def axis_tables(rows: List[Dict[str, Any]], best: Dict, plot_dir: Optional[str]) -> str:
    """Gap vs tokens per parameter at the most common size, and gap vs size at 20 tokens per
    parameter; each a markdown table, and a PNG when plot_dir is given."""
    pts = axes(rows, best)
    if not pts:
        return "(no axis point yet)"
    sizes = defaultdict(int)
    for r in rows:
        sizes[r["size"]] += 1
    main_size = max(sizes, key=lambda k: sizes[k])
    text = []
    for name, keep, xkey, xlabel in (
            ("length", lambda p: p[1] == main_size, 2, "training tokens per parameter"),
            ("size", lambda p: round(p[2]) == 20, 0, "parameters")):
        series = {g: sorted([p for p in v if keep(p)], key=lambda p: p[xkey])
                  for g, v in pts.items()}
        series = {g: v for g, v in series.items() if len(v) >= 2 or g in AXIS_METHODS and v}
        xs = sorted({p[xkey] for v in series.values() for p in v})
        if len(xs) < 2:
            text.append(f"The {name} axis: {len(xs)} point{'s' if len(xs) != 1 else ''} so far "
                        "(no table or plot).")
            continue
        head = "tokens/param" if name == "length" else "params"
        lines = ["| method | " + " | ".join(f"{x:.3g}" if name == "length" else f"{x / 1e6:.3f}M"
                                             for x in xs) + " |",
                 "|---|" + "---|" * len(xs)]
        for g, v in series.items():
            cell = {p[xkey]: f"{p[3]:+.1f}% ({p[4]})" for p in v}
            lines.append(f"| {g} | " + " | ".join(cell.get(x, "") for x in xs) + " |")
        title = (f"Gap to dense AdamS vs training length ({main_size}; % of dense AdamS's "
                 f"final loss, seeds in brackets), {head} across:" if name == "length" else
                 "Gap to dense AdamS vs model size (20 tokens per parameter), params across:")
        text += [title, "\n".join(lines)]
        if plot_dir:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(6, 4))
            for g, v in series.items():
                # the seeds' range as error bars; the options dashed beside their method
                ax.errorbar([p[xkey] for p in v], [p[3] for p in v],
                            yerr=[[p[3] - p[5] for p in v], [p[6] - p[3] for p in v]],
                            marker="o", capsize=3, label=g,
                            linestyle="-" if g in AXIS_METHODS else "--")
            ax.axhline(0, color="grey", lw=0.8)
            ax.set_xscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("final val loss gap to dense AdamS (%)\n(mean of seeds; bars: their range)")
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            png = os.path.join(plot_dir, f"quality_{name}.png")
            fig.savefig(png, dpi=110)
            plt.close(fig)
            text.append(f"Plot: {os.path.relpath(png)}")
    return "\n\n".join(text)


def by_params(rows: List[Dict[str, Any]], sizes) -> List[str]:
    """The given sizes, smallest model first."""
    return sorted(set(sizes), key=lambda s: next(r["params"] for r in rows if r["size"] == s))


def main_size(rows: List[Dict[str, Any]]) -> str:
    """The size with the most runs (the length axis's)."""
    n: Dict[str, int] = defaultdict(int)
    for r in rows:
        n[r["size"]] += 1
    return max(n, key=lambda k: n[k])


def point_cells(rows: List[Dict[str, Any]], best: Dict, base_ce: Dict[str, float], size: str,
                tpp: float) -> Optional[List[str]]:
    """dense AdamS, SCAPE 0.1 and SCAPE 0.01 at one point: mean ± half the seeds' range
    (seeds), the gap and the dense-step equivalent (None when dense AdamS has not run)."""
    dlr, _ = lr_of(rows, best, size, tpp, "adams")
    drs = at_lr(rows, size, tpp, "adams", dlr)
    if not drs:
        return None
    dv = np.array([r["final_val_loss"] for r in drs])
    ref = min(drs, key=lambda r: r["seed"])
    cells = [f"{dv.mean():.3f} ± {(dv.max() - dv.min()) / 2:.3f} ({len(dv)})"
             f"{flag(float(dv.mean()), base_ce)}"]
    for g in ("scape-0.1", "scape-0.01"):
        lr, _ = lr_of(rows, best, size, tpp, g)
        v = np.array([r["final_val_loss"] for r in at_lr(rows, size, tpp, g, lr)])
        if not len(v):
            cells.append("")
            continue
        _, txt = dense_steps_to(ref["curve"], float(v.mean()))
        cells.append(f"{v.mean():.3f} ± {(v.max() - v.min()) / 2:.3f} ({len(v)})"
                     f"{flag(float(v.mean()), base_ce)}: "
                     f"{100 * (v.mean() - dv.mean()) / dv.mean():+.1f}%, = step {txt}")
    return cells


def points_table(rows: List[Dict[str, Any]], best: Dict, base_ce: Dict[str, float],
                 head: str, points: List[Tuple[str, str, float]]) -> str:
    """One row per (label, size, tokens/param) point: point_cells, after the label and steps."""
    lines = [f"| {head} (steps) | dense AdamS | SCAPE 0.1 | SCAPE 0.01 |", "|---|---|---|---|"]
    for label, size, tpp in points:
        cells = point_cells(rows, best, base_ce, size, tpp)
        if cells:
            steps = next(r["steps"] for r in rows if r["size"] == size and
                         r["tokens_per_param"] == tpp)
            lines.append(f"| {label} ({steps}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def length_table(rows: List[Dict[str, Any]], best: Dict, base_ce: Dict[str, float]) -> str:
    """Per training length at the main size: dense AdamS and SCAPE 0.1 / 0.01, mean ± half the
    seeds' range (seeds), the gap and the dense-step equivalent."""
    size = main_size(rows)
    return points_table(rows, best, base_ce, "tokens/param",
                        [(f"{t:.3g}", size, t) for t in
                         sorted({r["tokens_per_param"] for r in rows if r["size"] == size})])


def size_table(rows: List[Dict[str, Any]], best: Dict, base_ce: Dict[str, float]) -> str:
    """The same per model size at 20 tokens per parameter."""
    pts = sorted({(r["params"], r["size"], r["tokens_per_param"]) for r in rows
                  if round(r["tokens_per_param"]) == 20})
    return points_table(rows, best, base_ce, "params",
                        [(f"{n / 1e6:.3f}M", size, t) for n, size, t in pts])


def options_table(rows: List[Dict[str, Any]], best: Dict) -> str:
    """Every option at 20 tokens per parameter against its method on the same seeds."""
    size = main_size(rows)
    tpps = [t for t in {r["tokens_per_param"] for r in rows} if round(t) == 20]
    lines = ["| option | density | lr | seeds | vs its method, same seeds (nats) | per seed |",
             "|---|---|---|---|---|---|"]
    for tpp in tpps:
        for g in sorted({r["group"] for r in rows if r["tokens_per_param"] == tpp and
                         r["size"] == size}):
            lr, note, base, d = option_diffs(rows, best, size, tpp, g)
            if d:
                lines.append(f"| {g[len(base) + 1:]} | {base[6:]} | {lr:g}{note} | {len(d)} | "
                             f"{np.mean([x for _, x in d]):+.3f} | "
                             + ", ".join(f"s{k}: {x:+.3f}" for k, x in d) + " |")
    return "\n".join(lines)


def option_diffs(rows: List[Dict[str, Any]], best: Dict, size: str, tpp: float,
                 g: str) -> Tuple[Optional[float], str, str, List[Tuple[int, float]]]:
    """(lr, its note, the method, [(seed, option - method on that seed)]) of option g at one
    point, against its method at the method's reported lr."""
    base = next((b for b in ("scape-0.01", "scape-0.1") if g.startswith(b + "-")), "")
    if not base:
        return None, "", "", []
    lr, note = lr_of(rows, best, size, tpp, g)
    blr, _ = lr_of(rows, best, size, tpp, base)
    bs = {r["seed"]: r["final_val_loss"] for r in at_lr(rows, size, tpp, base, blr)}
    d = [(r["seed"], r["final_val_loss"] - bs[r["seed"]])
         for r in sorted(at_lr(rows, size, tpp, g, lr), key=lambda r: r["seed"])
         if r["seed"] in bs]
    return lr, note, base, d


def kept_table(rows: List[Dict[str, Any]], best: Dict) -> str:
    """The options run at more than one point (the ones the screen kept, through both axes):
    at every point, against their method on the same seeds, and the gap to dense AdamS."""
    pts: Dict[str, set] = defaultdict(set)
    for r in rows:
        if r.get("stage") == "variant":
            pts[r["group"]].add((r["size"], r["tokens_per_param"]))
    kept = sorted(g for g, p in pts.items() if len(p) > 1)
    if not kept:
        return "(no option has run beyond the screen)"
    lines = ["| option | size | tokens/param | seeds | final val loss (mean) | vs its method, same "
             "seeds (nats) | per seed | gap to dense AdamS |", "|---|---|---|---|---|---|---|---|"]
    order = {s: i for i, s in enumerate(by_params(rows, (r["size"] for r in rows)))}
    for g in kept:
        for size, tpp in sorted(pts[g], key=lambda p: (order[p[0]], p[1])):
            lr, _, base, d = option_diffs(rows, best, size, tpp, g)
            mine = [r["final_val_loss"] for r in at_lr(rows, size, tpp, g, lr)]
            dlr, _ = lr_of(rows, best, size, tpp, "adams")
            dense = [r["final_val_loss"] for r in at_lr(rows, size, tpp, "adams", dlr)]
            label = next(r["size_label"] for r in rows if r["size"] == size)
            gap = (f"{100 * (np.mean(mine) / np.mean(dense) - 1):+.1f}%" if dense and mine
                   else "n/a")
            lines.append(f"| {g} | {label} | {tpp:.3g} | {len(mine)} | {np.mean(mine):.3f} | "
                         + (f"{np.mean([x for _, x in d]):+.3f}" if d else "n/a") + " | "
                         + ", ".join(f"s{k}: {x:+.3f}" for k, x in d) + f" | {gap} |")
    return "\n".join(lines)


def lrcheck_table(rows: List[Dict[str, Any]], best: Dict) -> str:
    """The axes' lr re-check (stage "lrcheck", seed 1): each method's loss at half and twice
    the lr it is reported at, beside that lr's, at each length where it ran."""
    pts = sorted({(r["size"], r["tokens_per_param"], r["group"]) for r in rows
                  if r.get("stage") == "lrcheck"})
    if not pts:
        return "(no lr re-check has run)"
    lines = ["| size | tokens/param | method | lr: final val loss (seed 1) | reported lr still "
             "best | on more seeds (mean, vs the reported lr on the same seeds) |",
             "|---|---|---|---|---|---|"]
    for size, tpp, g in pts:
        lr, _ = lr_of(rows, best, size, tpp, g)
        got = {r["lr"]: r["final_val_loss"] for r in rows if r["size"] == size and
               r["tokens_per_param"] == tpp and r["group"] == g and r["seed"] == 1}
        if lr not in got:
            continue
        b = min(got, key=lambda x: (got[x], x))
        verdict = "yes" if b == lr else f"no: {b:g} is {got[lr] - got[b]:.3f} nats lower"
        label = next(r["size_label"] for r in rows if r["size"] == size)
        # a moved lr confirmed on more seeds (scaling.py --lrcheck-seeds)
        per: Dict[float, Dict[int, float]] = defaultdict(dict)
        for r in rows:
            if r["size"] == size and r["tokens_per_param"] == tpp and r["group"] == g:
                per[r["lr"]][r["seed"]] = r["final_val_loss"]
        more = []
        for x in sorted(per):
            if x == lr or len(per[x]) < 2:
                continue
            common = sorted(set(per[x]) & set(per.get(lr, {})))
            if common:
                d = [per[x][k] - per[lr][k] for k in common]
                more.append(f"{x:g}: {np.mean([per[x][k] for k in common]):.3f} over seeds "
                            + ", ".join(str(k) for k in common)
                            + f" ({np.mean(d):+.3f}: " + ", ".join(f"{v:+.3f}" for v in d) + ")")
        lines.append(f"| {label} | {tpp:.3g} | {g} | " +
                     ", ".join(f"{x:g}{'*' if x == lr else ''}: {got[x]:.3f}" for x in sorted(got))
                     + f" | {verdict} | {'; '.join(more)} |")
    return "\n".join(lines)


def peers_table(rows: List[Dict[str, Any]], best: Dict) -> str:
    """The peers at 20 tokens per parameter (every size where they ran), seed by seed against
    the SCAPE density whose steady-state bytes they were matched to (PowerSGD-EF) or sit beside
    (top-k + EF): final loss, steady-state and warm-up bytes per step."""
    tpps = [t for t in {r["tokens_per_param"] for r in rows} if round(t) == 20]
    lines = ["| size | peer | seeds | final val loss (mean, per seed) | its SCAPE, same seeds | "
             "steady bytes/step (target) | SCAPE's steady bytes/step |",
             "|---|---|---|---|---|---|---|"]
    sizes = by_params(rows, (r["size"] for r in rows if r.get("stage") == "peer"))
    for size, tpp in [(s, t) for s in sizes for t in tpps]:
        label = next(r["size_label"] for r in rows if r["size"] == size)
        for g in sorted({r["group"] for r in rows if r["tokens_per_param"] == tpp and
                         r["size"] == size and r.get("stage") == "peer"}):
            rs = sorted([r for r in rows if r["tokens_per_param"] == tpp and r["size"] == size
                         and r["group"] == g], key=lambda r: r["seed"])
            dens = g.split("@")[1] if "@" in g else g.split("-")[1]
            sg = f"scape-{dens}"
            slr, _ = lr_of(rows, best, size, tpp, sg)
            ss = {r["seed"]: r for r in at_lr(rows, size, tpp, sg, slr)}
            mine = [r for r in rs if r["seed"] in ss]
            steady = np.mean([r.get("bytes_per_step_steady", r["bytes_per_step"]) for r in rs])
            target = rs[0].get("match_bytes")
            rank = f" rank {rs[0]['powersgd_rank']}" if rs[0].get("powersgd_rank") else ""
            # the runs that recorded it (the first q20 runs predate the steady-state field)
            sb = [r["bytes_per_step_steady"] for r in ss.values() if "bytes_per_step_steady" in r]
            s_steady = float(np.mean(sb)) if sb else float("nan")
            lines.append(
                f"| {label} | {g}{rank} | {len(rs)} | "
                f"{np.mean([r['final_val_loss'] for r in rs]):.3f} ("
                + ", ".join(f"s{r['seed']}: {r['final_val_loss']:.3f}" for r in rs) + ") | "
                + (f"{np.mean([ss[r['seed']]['final_val_loss'] for r in mine]):.3f} ("
                   + ", ".join(f"s{r['seed']}: {ss[r['seed']]['final_val_loss']:.3f}"
                               for r in mine) + ")" if mine else "n/a")
                + f" | {steady:,.0f}" + (f" ({target:,.0f})" if target else "")
                + f" | {s_steady:,.0f} |")
    return "\n".join(lines)


def report(out: str, plot_dir: Optional[str] = None) -> str:
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
        axis_tables(rows, best, plot_dir),
        "Per training length (final validation loss, mean ± half the seeds' range (seeds), the "
        "gap to dense AdamS and the dense-step equivalent):", length_table(rows, best, base),
        "Per model size at 20 tokens per parameter (the same columns):",
        size_table(rows, best, base),
        "The options at 20 tokens per parameter against their method on the same seeds:",
        options_table(rows, best),
        "The options the screen kept, through the axes (against their method on the same "
        "seeds, and their gap to dense AdamS):", kept_table(rows, best),
        "The peers at 20 tokens per parameter, seed by seed beside SCAPE at that density:",
        peers_table(rows, best),
        "The lr re-check at the length axis's ends (seed 1; * the lr the tables use):",
        lrcheck_table(rows, best),
        f"{len(rows)} runs in {out}/runs.jsonl."])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--md", help="also write the report to this file")
    ap.add_argument("--plots", help="write quality_length.png and quality_size.png here")
    a = ap.parse_args()
    text = report(a.out, a.plots)
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
