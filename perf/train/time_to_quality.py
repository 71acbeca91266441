#!/usr/bin/env python3
"""Time to quality: the quality study's loss curves against emulated wall-clock.

The quality study (perf/train/run_quality.sh, runs.jsonl) compares methods at equal steps; a
user compares them at equal time. This tool puts every run's validation-loss curve on a time
axis and prints the two tables a user decides by, per model size and link setting:

  a. equal wall-clock: each method's validation loss at dense AdamS's total time for its N-step
     run (a run that ends earlier says how far it got; runs longer than N steps, made for this
     table, are read where their time reaches dense's);
  b. time to dense AdamS's final loss (the median over its seeds), as a multiple of dense's
     time, each method allowed up to --max-time (4x) of it; "not reached" when its run ended
     first or never got there.

Time of one step, in units of that step's compute (forward + backward + optimizer):

    t(step) = 1 + R * f(step)

R is the link setting's compute:network ratio as perf/cluster defines it (a dense fp32 ring
all-reduce takes R times the compute; named settings: gh200-200g 2.2, h100-100gbe 4.5), and
f(step) the step's bytes as a fraction of that dense all-reduce: 1 for dense AdamS and AdamW;
for SCAPE the density schedule's d(step) (geometric warm-up from 1.0 over warmup_frac of the
run, the library's Optimizer::Density), scaled so that its mean over the run equals the run's
recorded avg_sent_fraction (payload plus mask, measured by the library's byte counters); for
PowerSGD 1 through its dense warm-up (warmup_frac), then constant, likewise scaled. This is the
alpha-beta model of perf/model.py with the mask sync hidden (perf/cluster measured 98-100% of
it hidden) and no fixed per-step overhead: perf/cluster's measured step times at 0.83M
parameters are within 1.01-1.14x of that model (perf/RESULTS_cluster.md). With --cluster
RESULTS.jsonl (a perf/cluster run at the same parameter count and rank count) the measured
step time of each method replaces the model at its steady-state density.

    python3 perf/train/time_to_quality.py perf/train/out-quality/runs.jsonl
    python3 perf/train/time_to_quality.py RUNS --size d96L3 --plot OUT.png --markdown OUT.md
    python3 perf/train/time_to_quality.py --self-test
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

NAMED_RATIOS = {"gh200-200g": 2.2, "h100-100gbe": 4.5}
DENSE_GROUPS = ("adams", "adamw")


# ---- per-step bytes and time ------------------------------------------------------------------

def scape_density(t: int, density: float, warmup_steps: int) -> float:
    """The library's density at step t (plugin/optim/optim.cc, Optimizer::Density)."""
    if t <= 0:
        return 1.0
    if warmup_steps > 0 and t < warmup_steps:
        return density ** (t / warmup_steps)
    return density


def sent_fractions(run: Dict[str, Any]) -> List[float]:
    """f(step) for each of the run's steps: bytes as a fraction of a dense fp32 all-reduce.
    Dense steps (dense methods, SCAPE's step 0 and density 1.0, PowerSGD's warm-up) are 1; the
    other steps follow the run's shape (SCAPE: its density; PowerSGD: constant), scaled so that
    the run's mean is its recorded avg_sent_fraction."""
    n = int(run["steps"])
    opt = run.get("opt", "")
    warm = int(round(float(run.get("warmup_frac") or 0.0) * n))
    if opt == "powersgd":
        shape = [1.0 if t < warm else 0.5 for t in range(n)]  # 0.5: any constant below 1
    elif opt in DENSE_GROUPS or float(run.get("density", 1.0)) >= 1.0:
        return [1.0] * n
    else:
        shape = [scape_density(t, float(run["density"]), warm) for t in range(n)]
    avg = run.get("avg_sent_fraction")
    dense = sum(1 for x in shape if x >= 1.0)
    sparse_sum = sum(x for x in shape if x < 1.0)
    c = 1.0 if avg is None or sparse_sum <= 0 else max(0.0, (float(avg) * n - dense) / sparse_sum)
    return [1.0 if x >= 1.0 else x * c for x in shape]


def step_costs(run: Dict[str, Any], ratio: float,
               measured: Optional[Dict[str, float]] = None) -> List[float]:
    """Each step's time in units of one step's compute. `measured`, if given, maps
    'dense' and the run's steady sent fraction to measured step times relative to compute."""
    fr = sent_fractions(run)
    if measured is None:
        return [1.0 + ratio * f for f in fr]
    # measured: {"compute": C, "dense": T_dense, "steady": T_steady}: interpolate in f
    c, td, ts = measured["compute"], measured["dense"], measured["steady"]
    f_steady = fr[-1] if fr else 1.0
    out = []
    for f in fr:
        if f >= 1.0 or f_steady >= 1.0:
            out.append(td / c)
        else:
            w = (f - f_steady) / (1.0 - f_steady)
            out.append((ts + w * (td - ts)) / c)
    return out


def loss_vs_time(run: Dict[str, Any], costs: Sequence[float]) -> List[Tuple[float, float]]:
    """(time, val_loss) at each evaluation of the run's curve; time in compute units."""
    cum = [0.0]
    for c in costs:
        cum.append(cum[-1] + c)
    pts = []
    for e in run.get("curve", []):
        s = min(int(e["step"]), len(costs))
        if e.get("val_loss") is not None:
            pts.append((cum[s], float(e["val_loss"])))
    return pts


def time_to(pts: Sequence[Tuple[float, float]], target: float) -> Optional[float]:
    """First time the curve reaches `target` (linear between evaluations), None if never."""
    for i, (t, v) in enumerate(pts):
        if v <= target:
            if i == 0:
                return t
            t0, v0 = pts[i - 1]
            return t0 + (t - t0) * (v0 - target) / (v0 - v) if v0 != v else t
    return None


def loss_at(pts: Sequence[Tuple[float, float]], when: float) -> Optional[float]:
    """The curve's loss at time `when` (linear between evaluations), None past its end."""
    if not pts or when > pts[-1][0] * (1 + 1e-9):
        return None
    for i, (t, v) in enumerate(pts):
        if t >= when:
            if i == 0:
                return v
            t0, v0 = pts[i - 1]
            return v0 + (v - v0) * (when - t0) / (t - t0) if t != t0 else v
    return pts[-1][1]


# ---- the tables ----------------------------------------------------------------------------

def summary(xs: Sequence[float]) -> str:
    if not xs:
        return "-"
    med = statistics.median(xs)
    if len(xs) == 1:
        return f"{med:.3f} (1 run)"
    return f"{med:.3f} [{min(xs):.3f}-{max(xs):.3f}] (n={len(xs)})"


def tables(runs: List[Dict[str, Any]], size: str, ratio_name: str, ratio: float,
           max_time: float, measured: Optional[Dict[str, Dict[str, float]]] = None
           ) -> Tuple[List[str], Dict[str, List[List[Tuple[float, float]]]]]:
    rs = [r for r in runs if r.get("size") == size and r.get("curve")]
    dense = [r for r in rs if r.get("group") == "adams"]
    if not dense:
        raise SystemExit(f"time_to_quality: no dense AdamS ('adams') run at size {size}")
    n_dense = max(int(r["steps"]) for r in dense)
    dense = [r for r in dense if int(r["steps"]) == n_dense]
    # lr: the study's chosen point is the lr with the most seeds at that length; the others
    # are sweep points
    def chosen(group_runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        by_lr: Dict[float, List[Dict[str, Any]]] = {}
        for r in group_runs:
            by_lr.setdefault(float(r["lr"]), []).append(r)
        best = max(by_lr.values(), key=lambda v: (len(v), -statistics.median(
            float(x["final_val_loss"]) for x in v)))
        return best
    dense = chosen(dense)
    measured = measured or {}
    target = statistics.median(float(r["final_val_loss"]) for r in dense)
    t_dense = statistics.median(sum(step_costs(r, ratio, measured.get("adams")))
                                for r in dense)
    dense_pts = [[(t / t_dense, v) for t, v in
                  loss_vs_time(r, step_costs(r, ratio, measured.get("adams")))] for r in dense]

    def dense_time_to(loss: float) -> Optional[float]:
        ts = [time_to(p, loss) for p in dense_pts]
        ts = [t for t in ts if t is not None]
        return statistics.median(ts) if len(ts) * 2 > len(dense_pts) else None
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for r in rs:
        if int(r["steps"]) < n_dense:
            continue  # shorter runs belong to other length points
        groups.setdefault(r["group"], []).append(r)
    lines = [f"### {size} ({dense[0].get('size_label', '')}), {ratio_name} (R = {ratio:g}), "
             f"dense AdamS {n_dense} steps, final loss {target:.3f} (median of "
             f"{len(dense)} seeds)", "",
             "| method | lr | runs | step time | loss at dense's time | time to dense's loss "
             "(x dense) | reached | its run's time (x dense) | time to its own final loss / "
             "dense's time to that loss |", "|---|---|---|---|---|---|---|---|---|"]
    curves: Dict[str, List[List[Tuple[float, float]]]] = {}
    for g in sorted(groups, key=lambda k: (k not in DENSE_GROUPS, k)):
        runs_g = chosen(groups[g])
        lat, ttl, own, same = [], [], [], []
        reached = 0
        m = measured.get(g)
        for r in runs_g:
            pts = loss_vs_time(r, step_costs(r, ratio, m))
            pts = [(t / t_dense, v) for t, v in pts]
            curves.setdefault(g, []).append(pts)
            own.append(pts[-1][0] if pts else float("nan"))
            mine = time_to(pts, float(r["final_val_loss"]))
            theirs = dense_time_to(float(r["final_val_loss"]))
            if mine is not None and theirs:
                same.append(mine / theirs)
            v = loss_at(pts, 1.0)
            if v is not None:
                lat.append(v)
            t = time_to(pts, target)
            if t is not None and t <= max_time:
                ttl.append(t)
                reached += 1
        la = summary(lat) if lat else f"ended first: final {summary([float(r['final_val_loss']) for r in runs_g])}"
        tt = summary(ttl) if ttl else "not reached"
        sm = ("-" if g in DENSE_GROUPS else summary(same) if same
              else "dense never gets there")
        lines.append(f"| {g} | {runs_g[0]['lr']:g} | {len(runs_g)} | "
                     f"{'measured' if m else 'model'} | {la} | {tt} | "
                     f"{reached} of {len(runs_g)} | {statistics.median(own):.2f} | {sm} |")
    lines.append("")
    return lines, curves


def plot(curves_by: Dict[str, Dict[str, List[List[Tuple[float, float]]]]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves_by), figsize=(6 * len(curves_by), 4.2), squeeze=False)
    for ax, (title, curves) in zip(axes[0], curves_by.items()):
        for g, cs in curves.items():
            for i, pts in enumerate(cs):
                ax.plot([t for t, _ in pts], [v for _, v in pts], lw=1,
                        label=g if i == 0 else None,
                        color=None if i == 0 else ax.lines[-1].get_color())
        ax.set_xlabel("emulated wall-clock (x dense AdamS's run)")
        ax.set_ylabel("validation loss")
        ax.set_title(title, fontsize=9)
        ax.set_ylim(top=min(ax.get_ylim()[1], 4.0))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load_cluster(path: str, params: int, ranks: int, ratio: float
                 ) -> Dict[str, Dict[str, float]]:
    """perf/cluster results at this parameter count, rank count and ratio: for each method it
    measured, {"compute": dense AdamS's compute_s, "dense": its step_s, "steady": the method's
    step_s}, keyed by the study's group names (scape-0.1, scape-0.01, adams, adamw)."""
    rs = [json.loads(ln) for ln in open(path) if ln.strip()]
    rs = [r for r in rs if int(r.get("params", 0)) == params and int(r.get("P", 0)) == ranks
          and abs(float(r.get("ratio_target", -1)) - ratio) < 1e-9]
    by = {r["method"]: r for r in rs}
    if "adams" not in by:
        return {}
    c, td = float(by["adams"]["compute_s"]), float(by["adams"]["step_s"])
    return {k: {"compute": c, "dense": td, "steady": float(v["step_s"])}
            for k, v in by.items() if k in ("adams", "adamw", "scape-0.1", "scape-0.01")}


# ---- self-test ------------------------------------------------------------------------------

def self_test() -> int:
    # density schedule as the library's
    assert scape_density(0, 0.01, 100) == 1.0
    assert abs(scape_density(50, 0.01, 100) - 0.1) < 1e-12
    assert scape_density(100, 0.01, 100) == 0.01 and scape_density(5, 0.01, 0) == 0.01
    # sent fractions keep the recorded mean, dense steps stay 1
    run = {"steps": 200, "opt": "scape", "density": 0.01, "warmup_frac": 0.1,
           "avg_sent_fraction": 0.05}
    fr = sent_fractions(run)
    assert abs(sum(fr) / len(fr) - 0.05) < 1e-9 and fr[0] == 1.0, (sum(fr) / len(fr), fr[:3])
    ps = {"steps": 100, "opt": "powersgd", "density": 0.1, "warmup_frac": 0.1,
          "avg_sent_fraction": 0.19}
    fp = sent_fractions(ps)
    assert fp[:10] == [1.0] * 10 and abs(fp[50] - 0.1) < 1e-9, fp[:12]
    # a dense run at ratio R costs (1 + R) per step; SCAPE's curve reaches a target earlier
    d = {"steps": 100, "opt": "adams", "group": "adams", "size": "s", "lr": 1.0, "seed": 1,
         "final_val_loss": 2.0, "curve": [{"step": 0, "val_loss": 5.0},
                                          {"step": 50, "val_loss": 3.0},
                                          {"step": 100, "val_loss": 2.0}]}
    assert abs(sum(step_costs(d, 2.0)) - 300.0) < 1e-9
    s = dict(d, opt="scape", group="scape-0.01", density=0.01, warmup_frac=0.0,
             avg_sent_fraction=0.02, final_val_loss=2.0)
    pts = loss_vs_time(s, step_costs(s, 2.0))
    # 100 steps of compute plus R times the run's bytes (2% of 100 dense all-reduces)
    assert abs(pts[-1][0] - (100 + 2.0 * 0.02 * 100)) < 1e-6, pts
    assert time_to(pts, 3.0) == pts[1][0] and time_to(pts, 1.0) is None
    assert abs(loss_at([(0.0, 4.0), (1.0, 2.0)], 0.5) - 3.0) < 1e-12
    assert loss_at([(0.0, 4.0), (1.0, 2.0)], 1.5) is None
    lines, _ = tables([d, s], "s", "x", 2.0, 4.0)
    row = [ln for ln in lines if ln.startswith("| scape-0.01")][0]
    assert "ended first" in row and "| 1 of 1 |" in row, row
    print("time_to_quality self-test: ok")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="?", help="the study's runs.jsonl")
    ap.add_argument("--size", action="append", help="model size key (default: the largest "
                    "with a dense AdamS run)")
    ap.add_argument("--ratio", action="append", metavar="NAME=R",
                    help="link settings (default: gh200-200g=2.2 h100-100gbe=4.5)")
    ap.add_argument("--max-time", type=float, default=4.0,
                    help="time allowed to reach dense's loss, x dense's time (default 4)")
    ap.add_argument("--plot", help="write the loss-vs-time plot here (PNG)")
    ap.add_argument("--markdown", help="write the tables here too")
    ap.add_argument("--cluster", help="a perf/cluster results.jsonl: measured step times "
                    "replace the model where its parameter count, rank count and ratio match")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args(argv)
    if a.self_test:
        return self_test()
    if not a.runs:
        ap.error("give the runs.jsonl (or --self-test)")
    runs = [json.loads(ln) for ln in open(a.runs) if ln.strip()]
    ratios = dict(NAMED_RATIOS)
    if a.ratio:
        ratios = {}
        for s in a.ratio:
            name, _, v = s.partition("=")
            try:
                ratios[name] = float(v) if v else NAMED_RATIOS[name]
            except (KeyError, ValueError):
                ap.error(f"--ratio {s!r}: expected NAME=R with R a number, or a named setting "
                         f"({', '.join(NAMED_RATIOS)})")
    sizes = a.size or []
    if not sizes:
        dense_sizes = {r["size"]: r.get("params", 0) for r in runs if r.get("group") == "adams"}
        if not dense_sizes:
            raise SystemExit("time_to_quality: no dense AdamS run in the file")
        sizes = [max(dense_sizes, key=lambda k: dense_sizes[k])]
    out: List[str] = []
    curves_by: Dict[str, Dict[str, List[List[Tuple[float, float]]]]] = {}
    for size in sizes:
        for name, r in ratios.items():
            meas = None
            if a.cluster:
                ref = next(x for x in runs if x.get("size") == size)
                meas = load_cluster(a.cluster, int(ref["params"]), int(ref["world_size"]), r)
                if not meas:
                    print(f"time_to_quality: {a.cluster} has no dense AdamS run at "
                          f"{ref['params']} parameters, P = {ref['world_size']}, R = {r:g}: "
                          f"the model prices every step", file=sys.stderr)
            lines, curves = tables(runs, size, name, r, a.max_time, meas)
            out += lines
            curves_by[f"{size}, {name} (R={r:g})"] = curves
    text = "\n".join(out)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
    if a.plot:
        plot(curves_by, a.plot)
        print(f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
