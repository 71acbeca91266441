"""The scaling study of issue 23: how SCAPE's gap to dense AdamS moves with model size, and the
peers at equal bytes, through the library, on the byte-level GPT and text of train.py.

Per model size (a fixed ratio of training tokens to parameters, so the number of steps grows
with the size) it runs, one after the other inside one job of W ranks:

  sweep   adamw, adams, scape-0.1, scape-0.01: seed 1 at every peak lr of the family's grid
          (one more grid point beyond an edge when the best value sits on it)
  seeds   the same four at their own best lr, seeds 2..S
  peers   topk-0.1, topk-0.01 (raw-gradient top-k + error feedback through
          Communicator.sparse_all_reduce, fed to AdamW at AdamW's best lr) and
          powersgd@0.1, powersgd@0.01 (torch's PowerSGD DDP communication hook, gloo, AdamW's
          best lr) at the matrix rank whose bytes per step come closest to the SCAPE run's
          measured bytes per step at that size and density
  variant scape-0.1-segrms, scape-0.01-segrms: ScapeAdamS(entering="segment_rms") at the
          best lr of scape-0.1 / scape-0.01, when the installed scape has that option (runs
          that the library cannot do yet are listed as pending, not recorded)

Every finished run is one JSON line of OUT/runs.jsonl, keyed by size, configuration, peak lr,
seed, steps and world size; a run whose key is already there is skipped, so the same command
continues an interrupted study (and picks up the variant once the library has it). Which runs
come next is decided from the recorded results (the sweep's best lr), identically on every
rank. perf/train/scaling_summary.py turns OUT into tables and plots.

    python3 -m scape.launch -n 4 perf/train/scaling.py --plan cpu --out perf/train/out-scaling
    bash perf/train/run_scaling.sh          # the same, per size, in the background-safe form

Plans: `smoke` (two tiny sizes, every configuration, a few steps: the CI check), `cpu` (the
study on the 2-core development VM), `gpu` (the same configurations at 20-50M parameters,
--device cuda; not run here). --sizes picks sizes of the plan, --dry-run prints the plan
with its steps and an estimate of its cost without training.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import data  # noqa: E402
import model as gpt  # noqa: E402
import scape  # noqa: E402
from scape.optim import ScapeAdamS  # noqa: E402
from train import BETAS, CLIP, WEIGHT_DECAY, lr_at  # noqa: E402

# Model sizes: name -> (d_model, n_layers, n_heads). Parameters with context 64 and the
# 257-token vocabulary (tied embeddings) are printed by --dry-run and recorded in every run.
SIZES: Dict[str, Tuple[int, int, int]] = {
    "d16L1": (16, 1, 2),        # smoke only
    "d24L1": (24, 1, 2),        # smoke only
    "d24L2": (24, 2, 2),        # 0.02M
    "d32L2": (32, 2, 4),        # 0.04M
    "d48L2": (48, 2, 4),        # 0.07M
    "d64L2": (64, 2, 4),        # 0.12M (the `full` plan of train.py)
    "d96L3": (96, 3, 4),        # 0.36M
    "d128L4": (128, 4, 4),      # 0.83M
    "d192L4": (192, 4, 6),      # 1.8M
    "d256L6": (256, 6, 8),      # 4.8M
    "d512L8": (512, 8, 8),      # 25M  (gpu)
    "d640L10": (640, 10, 10),   # 49M  (gpu)
}


@dataclass
class Plan:
    sizes: List[str]
    tokens_per_param: float
    context: int
    batch: int                  # sequences per rank per step (tokens_per_param 0: fixed)
    steps: int                  # steps a run aims at: the batch grows with the size
    seeds: int
    evals: int                  # evaluations per run (plus the one at step 0)
    eval_windows: int           # validation windows of the intermediate evaluations
    final_windows: int          # ... and of the final one
    min_steps: int
    grids: Dict[str, List[float]] = field(default_factory=dict)
    extend: bool = True         # one more lr beyond a grid edge that wins
    fixed_steps: int = 0        # timing runs: this many steps, the batch of the plan's size
    # issue 30: grids per configuration (over the family's), the grid extended until its best
    # point is interior (at most this many points beyond the edges), and the sweep ordered from
    # the middle of each grid outwards, interleaved across configurations, so that a study cut
    # short has every configuration's best region first
    group_grids: Dict[str, List[float]] = field(default_factory=dict)
    max_extend: int = 1
    swept: List[str] = field(default_factory=list)
    # issue 30's axes: no sweep of their own; every method at the best lr of plan `lr_plan`'s
    # sweep (the same out folder), at this plan's length and sizes
    lr_plan: str = ""
    # the peers and variants a plan runs (None: the scaling study's PEERS / VARIANTS); the axes
    # run the options the q20 screen kept (KEPT_Q)
    peers: Optional[List[str]] = None
    variants: Optional[List[str]] = None
    variant_seeds: int = 0  # seeds of a variant (0: the plan's); q20 screens with 2
    # a variant's lr: its method's best lr times this (--variant-lr-scale; an option that
    # changes the step size, as segment_rms does, needs its own lr checked)
    variant_lr_scale: float = 1.0
    # issue 30: the axes' lr re-check: seed 1 of every swept method at its sweep plan's lr times
    # each of these factors (stage "lrcheck"; the tables stay at the sweep plan's lr)
    lr_check: List[float] = field(default_factory=list)
    # seeds of the re-check (1: the plan's; --lrcheck-seeds 3 confirms a moved lr on 3 seeds)
    lr_check_seeds: int = 1
    # the plan whose sweep, seeds and peers this one repeats (the same run keys, skipped once
    # that plan ran): --dry-run then counts only this plan's variants
    repeats: str = ""


GRIDS_CPU = {"adamw": [1e-3, 3e-3, 1e-2], "adams": [3e-4, 1e-3, 3e-3],
             "scape": [1e-3, 3e-3, 1e-2]}
# issue 30 (plan q20): the screen of the options beside segment_rms (the clipping norm's
# source, the artifact's bias correction, momentum factor masking, each alone; one stack)
VARIANTS_Q = ["scape-0.1-segrms", "scape-0.01-segrms", "scape-0.1-clipstay", "scape-0.01-clipstay",
              "scape-0.1-artifact", "scape-0.01-artifact", "scape-0.01-localclip",
              "scape-0.1-localclip", "scape-0.1-segrms-mfm", "scape-0.01-segrms-mfm",
              # the stack of the two options that the screen's first round kept at 0.1
              "scape-0.1-artifact-localclip"]
# plan q20-more (in the full study only, beyond the 6-CPU-hour default): the same point's
# further checks: segment_rms stacked with the staying clip norm, no clipping and tighter clips, the payload's type (issue 33), local clipping
# through the library's own clip_norm="local" (issue 30, 3a: the screen's local clipping is
# torch's), and the noise floor of a same-seed comparison (SCAPE 0.1 at its lr x (1 + 1e-6))
VARIANTS_Q_MORE = ["scape-0.1-segrms-clipstay", "scape-0.01-segrms-clipstay", "scape-0.01-noclip", "scape-0.1-noclip", "scape-0.01-clip0.5",
                   "scape-0.01-clip0.25", "scape-0.1-clip0.5",
                   "scape-0.01-bf16", "scape-0.01-e4m3", "scape-0.01-e5m2",
                   "scape-0.1-clip-local", "scape-0.1-lr+1e-6"]
# the options the q20 screen kept (each lower than its method on every seed, at 0.1 only: at
# 0.01 none was), run through both axes; their stack first, so a study cut short has it
KEPT_Q = ["scape-0.1-artifact-localclip", "scape-0.1-artifact", "scape-0.1-localclip"]
PLANS: Dict[str, Plan] = {
    "smoke": Plan(["d16L1", "d24L1"], 0.0, 32, 4, 12, 1, 2, 32, 32, 12,
                  {"adamw": [3e-3], "adams": [3e-3], "scape": [1e-2]}, extend=False),
    "cpu": Plan(["d24L2", "d32L2", "d48L2", "d64L2", "d96L3", "d128L4"], 2.0, 64, 0, 240, 2, 4,
                256, 1024, 100, GRIDS_CPU),
    # beyond the ~2 h budget of `cpu`: run after it, in the background, into the same folder
    "cpu-xl": Plan(["d192L4"], 2.0, 64, 0, 240, 2, 4, 256, 1024, 100, GRIDS_CPU),
    # issue 30, step 1: the learning rate of every method at 20 tokens per parameter, one seed,
    # at the same tokens per step (4 sequences of 64 per rank) as every later point; grids of
    # 5 points spaced by 2x, extended until the best is interior
    "q20": Plan(["d64L2"], 20.0, 64, 4, 0, 3, 10, 256, 1024, 100,
                {"adamw": [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2],
                 "adams": [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3],
                 "scape": [5e-4, 1e-3, 2e-3, 4e-3, 8e-3]},
                group_grids={"scape-0.01": [2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2]},
                max_extend=4, swept=["adams", "scape-0.01", "scape-0.1", "adamw"],
                variants=VARIANTS_Q, variant_seeds=2),
    # issue 30, the two axes, dense AdamS and SCAPE at q20's best lr, 3 seeds (AdamW at q20
    # only: the CPU budget): length (0.12M at 2, 5, 10 and 40 tokens per parameter; 20 is q20
    # itself) and size at 20 tokens per parameter; q20's lr re-checked at the length axis's two
    # ends (half and twice it, seed 1)
    **{f"q-len{t}": Plan(["d64L2"], float(t), 64, 4, 0, 3, 10, 256, 1024, 20, {},
                         swept=["adams", "scape-0.01", "scape-0.1"], lr_plan="q20",
                         peers=[], variants=KEPT_Q,
                         lr_check=[0.5, 2.0] if t in (2, 40) else [])
       for t in (2, 5, 10, 40)},
    # the size axis also runs PowerSGD-EF at SCAPE's steady bytes of each size (the target
    # "below PowerSGD-EF at matched bytes" is at the largest size)
    "q-size": Plan(["d24L2", "d32L2", "d48L2", "d96L3"], 20.0, 64, 4, 0, 3, 10, 256, 1024, 100, {},
                   swept=["adams", "scape-0.01", "scape-0.1"], lr_plan="q20",
                   peers=["powersgd@0.1", "powersgd@0.01"], variants=KEPT_Q),
    "gpu": Plan(["d128L4", "d256L6", "d512L8", "d640L10"], 2.0, 256, 0, 1000, 2, 8, 512, 2048,
                300, {"adamw": [3e-4, 1e-3, 3e-3], "adams": [1e-4, 3e-4, 1e-3],
                      "scape": [3e-4, 1e-3, 3e-3]}),
}

# q20 again with the further checks (VARIANTS_Q_MORE): its sweep, seeds and peers are q20's runs
# (the same keys), so after q20 only the variants run
PLANS["q20-more"] = replace(PLANS["q20"], variants=VARIANTS_Q_MORE, repeats="q20")

# configuration -> (optimizer, density); the lr family it sweeps, or whose best lr it takes
CONFIGS: Dict[str, Dict[str, Any]] = {
    "adamw": dict(opt="adamw", density=1.0, sweep="adamw"),
    "adams": dict(opt="adams", density=1.0, sweep="adams"),
    "scape-0.1": dict(opt="scape", density=0.1, sweep="scape"),
    "scape-0.01": dict(opt="scape", density=0.01, sweep="scape"),
    "topk-0.1": dict(opt="topk", density=0.1, lr_from="adamw"),
    "topk-0.01": dict(opt="topk", density=0.01, lr_from="adamw"),
    "powersgd@0.1": dict(opt="powersgd", density=0.1, lr_from="adamw", match="scape-0.1"),
    "powersgd@0.01": dict(opt="powersgd", density=0.01, lr_from="adamw", match="scape-0.01"),
    "scape-0.1-segrms": dict(opt="scape", density=0.1, lr_from="scape-0.1",
                             entering="segment_rms"),
    "scape-0.01-segrms": dict(opt="scape", density=0.01, lr_from="scape-0.01",
                              entering="segment_rms"),
    # issue 30's options, each alone and stacked with segment_rms: the clipping norm over the
    # staying coordinates, the artifact's bias correction
    "scape-0.1-clipstay": dict(opt="scape", density=0.1, lr_from="scape-0.1",
                               options="clip_norm=staying"),
    "scape-0.01-clipstay": dict(opt="scape", density=0.01, lr_from="scape-0.01",
                                options="clip_norm=staying"),
    "scape-0.1-artifact": dict(opt="scape", density=0.1, lr_from="scape-0.1",
                               options="bias_correction=artifact"),
    "scape-0.01-artifact": dict(opt="scape", density=0.01, lr_from="scape-0.01",
                                options="bias_correction=artifact"),
    # issue 30, 3b: segment_rms with momentum factor masking (the kept momentum of an entering
    # coordinate clamped to one step's worth: entering="segment_rms_masked")
    "scape-0.1-segrms-mfm": dict(opt="scape", density=0.1, lr_from="scape-0.1",
                                 entering="segment_rms_masked"),
    "scape-0.01-segrms-mfm": dict(opt="scape", density=0.01, lr_from="scape-0.01",
                                  entering="segment_rms_masked"),
    "scape-0.1-segrms-clipstay": dict(opt="scape", density=0.1, lr_from="scape-0.1",
                                      entering="segment_rms", options="clip_norm=staying"),
    "scape-0.01-segrms-clipstay": dict(opt="scape", density=0.01, lr_from="scape-0.01",
                                       entering="segment_rms", options="clip_norm=staying"),
    # issue 30, item 3a screened before the library gets it: no clipping at all, and Deep
    # Gradient Compression's local clipping (each rank clips its own gradient to the norm
    # CLIP before it enters the candidate and the residual; the average of vectors of norm
    # <= CLIP has norm <= CLIP), done here with torch's clip_grad_norm_ on the local
    # gradient and the library's clipping off
    "scape-0.1-noclip": dict(opt="scape", density=0.1, lr_from="scape-0.1",
                             options="max_grad_norm=0"),
    "scape-0.01-noclip": dict(opt="scape", density=0.01, lr_from="scape-0.01",
                              options="max_grad_norm=0"),
    # ... and a tighter clip of the recovered gradient than the study's CLIP (the two above
    # lost ~0.27 nats at 0.01: the clip helps there, so does more of it?)
    "scape-0.01-clip0.5": dict(opt="scape", density=0.01, lr_from="scape-0.01",
                               options="max_grad_norm=0.5"),
    "scape-0.01-clip0.25": dict(opt="scape", density=0.01, lr_from="scape-0.01",
                                options="max_grad_norm=0.25"),
    "scape-0.1-clip0.5": dict(opt="scape", density=0.1, lr_from="scape-0.1",
                              options="max_grad_norm=0.5"),
    "scape-0.1-localclip": dict(opt="scape", density=0.1, lr_from="scape-0.1",
                                options="max_grad_norm=0,local_clip=1"),
    "scape-0.01-localclip": dict(opt="scape", density=0.01, lr_from="scape-0.01",
                                 options="max_grad_norm=0,local_clip=1"),
    # ... and the same through the library's own option (clip_norm="local", no torch clip): a
    # check that the library gives what the screen measured (--only, seed 1)
    "scape-0.1-clip-local": dict(opt="scape", density=0.1, lr_from="scape-0.1",
                                 options="clip_norm=local"),
    # the default with its lr changed in the 7th digit: whatever differs from scape-0.1 on the
    # same seed is how far last-bit differences carry (an option's same-seed difference is
    # only news beyond it)
    "scape-0.1-lr+1e-6": dict(opt="scape", density=0.1, lr_from="scape-0.1", lr_scale=1.000001),
    "scape-0.1-artifact-localclip": dict(opt="scape", density=0.1, lr_from="scape-0.1",
                                         options="bias_correction=artifact,max_grad_norm=0,"
                                                 "local_clip=1"),
    # issue 33: the payload's type (bf16; the 8-bit floats with a shared scale per step)
    **{f"scape-0.01-{t}": dict(opt="scape", density=0.01, lr_from="scape-0.01",
                                options=f"payload_dtype={t}")
       for t in ("bf16", "e4m3", "e5m2")},
}
SWEPT = ["adamw", "adams", "scape-0.1", "scape-0.01"]
PEERS = ["topk-0.1", "topk-0.01", "powersgd@0.1", "powersgd@0.01"]
VARIANTS = ["scape-0.1-segrms", "scape-0.01-segrms"]
DENSITY_WARMUP_FRAC = 0.1   # SCAPE's geometric density warm-up from 1.0, fraction of the steps
POWERSGD_START_ITER = 2     # the hook's vanilla all-reduce steps (its minimum with feedback)
MAX_POWERSGD_RANK = 64


def has_entering() -> bool:
    """Whether the installed scape.optim.ScapeAdamS takes the `entering` option (issue 23)."""
    try:
        return "entering" in inspect.signature(ScapeAdamS.__init__).parameters
    except (TypeError, ValueError):
        return False


def model_config(size: str, context: int) -> gpt.GPTConfig:
    d, n_layers, heads = SIZES[size]
    return gpt.GPTConfig(vocab=data.VOCAB, context=context, d_model=d, n_layers=n_layers,
                         n_heads=heads)


_SHAPES: Dict[Tuple[str, int], List[Tuple[int, ...]]] = {}


def param_shapes(size: str, context: int) -> List[Tuple[int, ...]]:
    if (size, context) not in _SHAPES:
        m = gpt.GPT(model_config(size, context))
        _SHAPES[(size, context)] = [tuple(p.shape) for p in m.parameters()]
    return _SHAPES[(size, context)]


def n_params(size: str, context: int) -> int:
    return int(sum(np.prod(s) for s in param_shapes(size, context)))


def size_label(n: int) -> str:
    """"0.022M params", "0.37M params", "1.8M params", "25M params": two significant digits."""
    return f"{float(f'{n / 1e6:.2g}'):g}M params"


def ring_bytes(elements: float, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of `elements` fp32 values (gloo and the
    hook report none; the same estimate as train.py's AdamW baseline)."""
    return 2 * (world - 1) / world * 4 * elements if world > 1 else 0.0


def powersgd_elements(shapes: List[Tuple[int, ...]], rank: int, min_rate: float = 2.0) -> int:
    """Elements the PowerSGD hook all-reduces per compressed step: P and Q of each matrix it
    compresses, the rest uncompressed (the rule of torch's _should_compress)."""
    tot = 0
    for s in shapes:
        n = s[0]
        m = int(np.prod(s[1:])) if len(s) > 1 else 1
        r = min(n, m, rank)
        if (n + m) * r * min_rate < n * m:
            tot += (n + m) * r
        else:
            tot += n * m
    return tot


def powersgd_bytes_per_step(shapes: List[Tuple[int, ...]], rank: int, steps: int,
                            world: int) -> float:
    full = sum(int(np.prod(s)) for s in shapes)
    k = min(steps, POWERSGD_START_ITER)
    el = k * full + (steps - k) * powersgd_elements(shapes, rank)
    return ring_bytes(el / max(1, steps), world)


def match_powersgd_rank(shapes: List[Tuple[int, ...]], target: float, steps: int,
                        world: int, steady: bool = False) -> Tuple[int, float]:
    """The matrix rank whose bytes per step come closest (in ratio) to `target`: the mean over
    the run (warm-up included), or with `steady` the bytes of one compressed step (issue 30:
    matched to SCAPE's steady state, both warm-ups reported apart)."""
    def bytes_of(r: int) -> float:
        if steady:
            return ring_bytes(powersgd_elements(shapes, r), world)
        return powersgd_bytes_per_step(shapes, r, steps, world)

    best = (1, bytes_of(1))
    for r in range(2, MAX_POWERSGD_RANK + 1):
        b = bytes_of(r)
        if abs(math.log(b / target)) < abs(math.log(best[1] / target)):
            best = (r, b)
    return best


@dataclass
class Run:
    size: str
    group: str
    opt: str
    seed: int
    steps: int
    lr: float
    density: float
    stage: str                    # sweep | seed | lrcheck | peer | variant
    world_size: int
    batch: int                    # sequences per rank per step
    warmup_frac: float = 0.0
    entering: str = ""
    options: str = ""             # more ScapeAdamS keywords, "k=v,k=v" (issue 30's options)
    powersgd_rank: int = 0
    match_bytes: float = 0.0      # the SCAPE bytes per step a powersgd run was matched to
    powersgd_bytes_predicted: float = 0.0   # bytes per step of its rank (powersgd_bytes_per_step)

    def key(self) -> str:
        return (f"{self.size}|{self.group}|lr{self.lr:g}|s{self.seed}|n{self.steps}"
                f"|w{self.world_size}")


def run_key(r: Dict[str, Any]) -> str:
    return (f"{r['size']}|{r['group']}|lr{r['lr']:g}|s{r['seed']}|n{r['steps']}"
            f"|w{r['world_size']}")


class Schedule:
    """Which runs a plan needs, given the results so far (deterministic, so every rank agrees).
    Runs that depend on an unfinished sweep or SCAPE run are not listed yet."""

    def __init__(self, plan: Plan, world: int, variant: bool) -> None:
        self.plan, self.world, self.variant = plan, world, variant

    def steps(self, size: str) -> Tuple[int, int]:
        """(steps, sequences per rank per step) of a run at this size: the batch that brings
        the fixed tokens-per-parameter budget closest to the plan's step count."""
        pl = self.plan
        if not pl.tokens_per_param:
            return pl.min_steps, pl.batch
        tokens = pl.tokens_per_param * n_params(size, pl.context)
        seq = self.world * pl.context
        b = pl.batch or max(1, int(round(tokens / (seq * pl.steps))))
        if pl.fixed_steps:
            return pl.fixed_steps, b
        return max(pl.min_steps, int(round(tokens / (seq * b)))), b

    def done(self, results: List[Dict[str, Any]], size: str, group: str,
             seed: Optional[int] = None) -> List[Dict[str, Any]]:
        """The finished runs of this plan's length at `size` (plans of other lengths may share
        the out folder)."""
        steps = self.steps(size)[0]
        return [r for r in results if r["size"] == size and r["group"] == group
                and r["steps"] == steps and (seed is None or r["seed"] == seed)]

    def sweep_lrs(self, results: List[Dict[str, Any]], size: str, group: str) -> List[float]:
        pl = self.plan
        grid = list(pl.group_grids.get(group) or pl.grids[CONFIGS[group]["sweep"]])
        if not pl.extend:
            return grid
        got = {r["lr"]: r["final_val_loss"] for r in self.done(results, size, group, 1)}
        for _ in range(max(1, pl.max_extend)):
            if not all(lr in got for lr in grid):
                return grid
            best = min(grid, key=lambda lr: (got[lr], lr))
            if best == grid[-1]:
                grid.append(grid[-1] * grid[-1] / grid[-2])
            elif best == grid[0] and len(grid) > 1:
                grid.insert(0, grid[0] * grid[0] / grid[1])
            else:
                break
        return grid

    @staticmethod
    def middle_out(grid: List[float]) -> List[float]:
        """The grid from its middle point outwards (middle, right, left, ...)."""
        mid = len(grid) // 2
        order = [grid[mid]]
        for d in range(1, len(grid)):
            for i in (mid + d, mid - d):
                if 0 <= i < len(grid):
                    order.append(grid[i])
        return order

    def best_lr(self, results: List[Dict[str, Any]], size: str, group: str) -> Optional[float]:
        if "sweep" not in CONFIGS[group]:
            return None
        if self.plan.lr_plan:  # the axes: the lr of the sweep plan, at its size
            src = Schedule(PLANS[self.plan.lr_plan], self.world, self.variant)
            return src.best_lr(results, src.plan.sizes[0], group)
        lrs = self.sweep_lrs(results, size, group)
        got = {r["lr"]: r["final_val_loss"] for r in self.done(results, size, group, 1)}
        if not all(lr in got for lr in lrs):
            return None
        return min(lrs, key=lambda lr: (got[lr], lr))

    def runs(self, results: List[Dict[str, Any]], size: str) -> Tuple[List[Run], List[str]]:
        """(the runs of this size known now, in order; configurations not yet schedulable
        with the reason)."""
        out: List[Run] = []
        waiting: List[str] = []
        steps, batch = self.steps(size)
        seeds = list(range(1, self.plan.seeds + 1))

        def mk(group: str, seed: int, lr: float, stage: str, **kw: Any) -> Run:
            c = CONFIGS[group]
            return Run(size, group, c["opt"], seed, steps, lr, c["density"], stage, self.world,
                       batch, warmup_frac=DENSITY_WARMUP_FRAC if c["opt"] == "scape" else 0.0,
                       entering=c.get("entering", ""), options=c.get("options", ""), **kw)

        best: Dict[str, Optional[float]] = {}
        swept = self.plan.swept or SWEPT
        if self.plan.lr_plan:
            pass  # no sweep: every seed at the sweep plan's best lr (below)
        elif self.plan.swept:  # interleaved, each grid from its middle outwards
            grids = {g: self.middle_out(self.sweep_lrs(results, size, g)) for g in swept}
            for i in range(max(len(v) for v in grids.values())):
                for g in swept:
                    if i < len(grids[g]):
                        out.append(mk(g, 1, grids[g][i], "sweep"))
        else:
            for g in swept:
                for lr in self.sweep_lrs(results, size, g):
                    out.append(mk(g, 1, lr, "sweep"))
        for g in swept:
            best[g] = self.best_lr(results, size, g)
        for g in ((PEERS if self.plan.peers is None else self.plan.peers)
                  + (VARIANTS if self.plan.variants is None else self.plan.variants)):
            src = CONFIGS[g]["lr_from"]  # a peer's lr family need not be swept by this plan
            if src not in best:
                best[src] = self.best_lr(results, size, src)
        for g in swept:
            if best[g] is None:
                waiting.append(f"{g} seeds 2..: its sweep")
        # seed-major: a study cut short has every method's first seeds, not one method's three
        for s in (seeds if self.plan.lr_plan else seeds[1:]):
            for g in swept:
                if best[g] is not None:
                    out.append(mk(g, s, best[g], "seed"))
        # after every seed: the lr re-check of the axes (seed 1 at the sweep plan's lr x factor)
        for f in (self.plan.lr_check if self.plan.lr_plan else []):
            for s in seeds[:max(1, self.plan.lr_check_seeds)]:
                for g in swept:
                    if best[g] is not None:
                        out.append(mk(g, s, best[g] * f, "lrcheck"))
        shapes = param_shapes(size, self.plan.context)
        for g in (PEERS if self.plan.peers is None else self.plan.peers):
            c = CONFIGS[g]
            lr = best[c["lr_from"]]
            if lr is None:
                waiting.append(f"{g}: the {c['lr_from']} sweep")
                continue
            kw: Dict[str, Any] = {}
            if c["opt"] == "powersgd":
                steady = bool(self.plan.swept)  # issue 30's plans: the steady state
                key = "bytes_per_step_steady" if steady else "bytes_per_step"
                ref = [r[key] for r in self.done(results, size, c["match"]) if key in r]
                if not ref:
                    waiting.append(f"{g}: a {c['match']} run to match its bytes")
                    continue
                target = float(np.mean(ref))
                rank, pred = match_powersgd_rank(shapes, target, steps, self.world, steady)
                kw = dict(powersgd_rank=rank, match_bytes=target, powersgd_bytes_predicted=pred)
            for s in seeds:
                out.append(mk(g, s, lr, "peer", **kw))
        for g in (VARIANTS if self.plan.variants is None else self.plan.variants):
            c = CONFIGS[g]
            lr = best[c["lr_from"]]
            if lr is not None:
                lr *= self.plan.variant_lr_scale * c.get("lr_scale", 1.0)
            if not self.variant:
                waiting.append(f"{g}: the library has no ScapeAdamS(entering=...) yet")
                continue
            if lr is None:
                waiting.append(f"{g}: the {c['lr_from']} sweep")
                continue
            for s in seeds[:self.plan.variant_seeds or len(seeds)]:
                out.append(mk(g, s, lr, "variant"))
        return out, waiting


def serial_powersgd_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    """torch's powerSGD_hook, one bucket at a time. The hook chains all-reduces (P, then Q)
    in completion callbacks; with several buckets on gloo the ranks can then issue them in
    different orders, and gloo pairs the wrong messages (seen: "op.preamble.length <=
    op.nbytes"). Waiting for each bucket keeps the order identical on every rank; the bytes
    and the algorithm are unchanged, the overlap of communication with backward is lost."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph

    fut = ph.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def read_runs(path: str) -> List[Dict[str, Any]]:
    """The finished runs of runs.jsonl; a line cut short (a job killed while writing it) is
    skipped, so that run is done again."""
    out: List[Dict[str, Any]] = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    if line.strip():
                        out.append(json.loads(line))
                except ValueError:
                    print(f"{path}: skipping a damaged line", file=sys.stderr)
    return out


def weights_hash(m: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in m.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class Study:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.plan = PLANS[args.plan]
        if args.sizes:
            self.plan.sizes = list(args.sizes)
        if args.seeds:
            self.plan.seeds = args.seeds
        if args.peers is not None:
            self.plan.peers = list(args.peers)
        if args.lrcheck_seeds:
            self.plan.lr_check_seeds = args.lrcheck_seeds
        if args.lrcheck_factors is not None:
            self.plan.lr_check = args.lrcheck_factors
        if args.tokens_per_param:
            self.plan.tokens_per_param = args.tokens_per_param
        if args.steps:
            self.plan.fixed_steps = args.steps
        if args.variant_lr_scale:
            self.plan.variant_lr_scale = args.variant_lr_scale
        if args.variant_seeds:
            self.plan.variant_seeds = args.variant_seeds
        if args.lr:
            self.plan.grids = {k: [args.lr] for k in self.plan.grids}
            self.plan.group_grids = {}
            self.plan.extend = False
        self.device = torch.device(args.device)
        self.comm = scape.Communicator.from_env()
        self.rank, self.size = self.comm.rank, self.comm.size
        self.schedule = Schedule(self.plan, self.size, has_entering())
        self.corpus = data.load()
        shard = data.rank_shard(self.corpus.train_docs, self.rank, self.size)
        self.train_stream = data.encode(shard)
        self.val_stream = data.encode(self.corpus.val_docs)
        import torch.distributed as dist

        self.dist = dist
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=self.rank, world_size=self.size)
        self.out_dir = args.out
        self.results: List[Dict[str, Any]] = []
        self.results = read_runs(os.path.join(self.out_dir, "runs.jsonl"))
        self.comm.barrier()  # every rank read the same file before rank 0 appends to it

    # -- helpers ---------------------------------------------------------------------------

    def allsum(self, values: List[float]) -> List[float]:
        x = np.array(values, dtype=np.float32)
        self.comm.all_reduce(x, op="sum")
        return [float(v) for v in x]

    @torch.no_grad()
    def evaluate(self, m: torch.nn.Module, windows: int) -> float:
        val = data.eval_windows(self.val_stream, self.plan.context, windows)[self.rank::self.size]
        val = torch.from_numpy(val).to(self.device)
        m.eval()
        tot, cnt = 0.0, 0.0
        for i in range(0, len(val), 32):
            w = val[i:i + 32]
            tot += float(m(w[:, :-1], w[:, 1:])) * len(w)
            cnt += len(w)
        m.train()
        tot, cnt = self.allsum([tot, cnt])
        return tot / cnt

    def identical(self, m: torch.nn.Module) -> bool:
        h = np.frombuffer(bytes.fromhex(weights_hash(m)), dtype=np.int64).copy()
        allh = self.comm.all_gather(h).reshape(self.size, -1)
        return bool((allh == allh[0]).all())

    def set_grads(self, params: List[torch.Tensor], flat: torch.Tensor) -> None:
        i = 0
        for p in params:
            p.grad.copy_(flat[i:i + p.numel()].view_as(p))
            i += p.numel()

    # -- one run ---------------------------------------------------------------------------

    def run(self, r: Run) -> Dict[str, Any]:
        pl = self.plan
        cpu0 = time.process_time()
        wall0 = time.perf_counter()
        torch.manual_seed(r.seed)
        m = gpt.GPT(model_config(r.size, pl.context)).to(self.device)
        params = list(m.parameters())
        n = sum(p.numel() for p in params)
        tps = r.batch * pl.context * self.size
        batches = data.Batches(self.train_stream, pl.context, r.batch,
                               seed=r.seed * 1000 + self.rank)
        fwd: torch.nn.Module = m
        opt: Any
        psgd = None
        psgd_start = POWERSGD_START_ITER
        if r.opt in ("adams", "scape"):
            kw: Dict[str, Any] = {"max_grad_norm": CLIP}
            if r.entering:
                kw["entering"] = r.entering
            for item in filter(None, r.options.split(",")):
                k, v = item.split("=", 1)
                kw[k] = float(v) if k == "max_grad_norm" else v
            local_clip = float(kw.pop("local_clip", 0.0)) * CLIP
            opt = ScapeAdamS(params, self.comm, lr=r.lr, betas=BETAS, eps=1e-8,
                             weight_decay=WEIGHT_DECAY, density=r.density,
                             warmup_steps=int(r.warmup_frac * r.steps), **kw)
        else:
            if r.opt == "powersgd":
                from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph
                from torch.nn.parallel import DistributedDataParallel as DDP

                fwd = DDP(m, device_ids=None if self.device.type == "cpu" else [self.device],
                          broadcast_buffers=False)
                if self.plan.swept:  # issue 30: SCAPE's warm-up, dense, for PowerSGD too
                    psgd_start = max(POWERSGD_START_ITER, int(DENSITY_WARMUP_FRAC * r.steps))
                psgd = ph.PowerSGDState(process_group=None,
                                        matrix_approximation_rank=r.powersgd_rank,
                                        start_powerSGD_iter=psgd_start,
                                        use_error_feedback=True, warm_start=True,
                                        random_seed=r.seed)
                fwd.register_comm_hook(psgd, serial_powersgd_hook)
            opt = torch.optim.AdamW(params, lr=r.lr, betas=BETAS, eps=1e-8,
                                    weight_decay=WEIGHT_DECAY)
            if r.opt == "topk":
                resid = torch.zeros(n, device=self.device)
                offs = np.cumsum([0] + [p.numel() for p in params])
                dense_seg = [p.dim() <= 1 for p in params]
        eval_at = sorted({int(round(i * r.steps / pl.evals)) for i in range(pl.evals + 1)})
        curve, sent, frac, same = [], [], [], []
        train_time = 0.0
        loss_val = float("nan")
        psgd_prev = 0
        for step in range(r.steps + 1):
            if step in eval_at:
                v = self.evaluate(m, pl.final_windows if step == r.steps else pl.eval_windows)
                ok = self.identical(m)
                same.append(ok)
                curve.append({"step": step, "tokens": step * tps, "val_loss": v,
                              "train_loss": loss_val if step else None, "identical": ok})
            if step == r.steps:
                break
            t0 = time.perf_counter()
            lr = lr_at(step, r.steps, r.lr)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = batches.next()
            opt.zero_grad()
            loss = fwd(torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device))
            loss.backward()
            loss_val = float(loss)
            if r.opt in ("adams", "scape"):
                if local_clip:
                    torch.nn.utils.clip_grad_norm_(params, local_clip)
                opt.step()
                info = opt.info()[0]
                sent.append(info["bytes_sent"])
                frac.append(info["mask_count"] / n)
            elif r.opt == "adamw":
                g = torch.cat([p.grad.reshape(-1) for p in params])
                self.dist.all_reduce(g)
                g /= self.size
                self.set_grads(params, g)
                torch.nn.utils.clip_grad_norm_(params, CLIP)
                opt.step()
                sent.append(ring_bytes(n, self.size))
                frac.append(1.0)
            elif r.opt == "powersgd":
                # DDP averaged the (compressed) gradients during backward
                after = psgd.total_numel_after_compression
                el = n if step < psgd_start else after - psgd_prev
                psgd_prev = after
                torch.nn.utils.clip_grad_norm_(params, CLIP)
                opt.step()
                sent.append(ring_bytes(el, self.size))
                frac.append(el / n)
            else:  # topk with error feedback
                g = torch.cat([p.grad.reshape(-1) for p in params])
                resid += g
                idx = []
                for k, (a, b) in enumerate(zip(offs[:-1], offs[1:])):
                    if b == a:
                        continue
                    if dense_seg[k]:
                        idx.append(np.arange(a, b))
                        continue
                    kk = max(1, int(r.density * (b - a)))
                    top = torch.topk(resid[a:b].abs(), kk, sorted=False).indices.cpu().numpy()
                    idx.append(np.sort(top) + a)
                ii = np.concatenate(idx).astype(np.uint64)
                it = torch.from_numpy(ii.astype(np.int64)).to(self.device)
                vals = resid[it].contiguous().cpu()
                resid[it] = 0.0
                res = self.comm.sparse_all_reduce(ii, vals, n, op="avg")
                gavg = res.dense if isinstance(res.dense, torch.Tensor) else \
                    torch.from_numpy(res.dense)
                self.set_grads(params, gavg.to(self.device))
                torch.nn.utils.clip_grad_norm_(params, CLIP)
                opt.step()
                sent.append(res.bytes_sent)
                frac.append(len(ii) / n)
            train_time += time.perf_counter() - t0
        tokens = r.steps * tps
        warm = int(r.warmup_frac * r.steps) + 1 if r.opt == "scape" else 0
        if r.opt == "powersgd":
            warm = psgd_start
        cpu = self.allsum([time.process_time() - cpu0])[0]
        out = {
            **asdict(r), "key": r.key(), "params": n, "size_label": size_label(n),
            "d_model": SIZES[r.size][0], "n_layers": SIZES[r.size][1],
            "n_heads": SIZES[r.size][2], "context": pl.context,
            "tokens_per_param": tokens / n, "device": str(self.device),
            "final_val_loss": curve[-1]["val_loss"], "curve": curve, "tokens": tokens,
            "train_seconds": train_time, "wall_seconds": time.perf_counter() - wall0,
            "cpu_seconds_all_ranks": cpu,
            "tokens_per_second": tokens / train_time if train_time else None,
            "bytes_per_step": float(np.mean(sent)) if sent else 0.0,
            # after the density warm-up (SCAPE) / the dense start (PowerSGD): the steady state
            "bytes_per_step_steady": float(np.mean(sent[warm:])) if sent[warm:] else 0.0,
            "bytes_per_step_warmup": float(np.mean(sent[:warm])) if sent[:warm] else 0.0,
            "bytes_per_step_dense_fp32_ring": ring_bytes(n, self.size),
            "avg_sent_fraction": float(np.mean(frac)) if frac else 1.0,
            "ranks_identical": all(same), "final_param_hash": weights_hash(m),
            "git": _git(),
        }
        if r.opt == "powersgd":
            out["bytes_estimate"] = "ring volume of the elements the hook all-reduced " \
                                    "(its total_numel_after_compression)"
        if isinstance(opt, ScapeAdamS):
            opt.destroy()
        return out

    # -- the study -------------------------------------------------------------------------

    def record(self, res: Dict[str, Any]) -> None:
        self.results.append(res)
        if self.rank == 0:
            path = os.path.join(self.out_dir, "runs.jsonl")
            with open(path, "a+b") as f:
                f.seek(0, os.SEEK_END)
                if f.tell():  # after a line cut short by a kill: start a new one
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        f.write(b"\n")
                f.write((json.dumps(res) + "\n").encode())

    def main(self) -> int:
        if self.rank == 0:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, f"plan-{self.args.plan}.json"), "w") as f:
                json.dump({"plan": asdict(self.plan), "world_size": self.size,
                           "corpus": self.corpus.describe(),
                           "betas": BETAS, "weight_decay": WEIGHT_DECAY, "clip": CLIP,
                           "density_warmup_frac": DENSITY_WARMUP_FRAC,
                           "variant_available": self.schedule.variant,
                           "torch": torch.__version__, "cores": os.cpu_count()}, f, indent=1)
        t_job = time.perf_counter()
        ok = True
        for size in self.plan.sizes:
            while True:
                have = {run_key(x) for x in self.results}
                todo, waiting = self.schedule.runs(self.results, size)
                pending = [r for r in todo if r.key() not in have
                           and (not self.args.only or r.group in self.args.only)
                           and (r.stage == "sweep" or not self.args.sweep_only)]
                if not pending:
                    if self.rank == 0 and waiting:
                        print(f"{size}: not schedulable: {'; '.join(waiting)}", flush=True)
                    break
                r = pending[0]
                res = self.run(r)
                self.record(res)
                ok = ok and res["ranks_identical"]
                if self.rank == 0:
                    extra = f" rank {r.powersgd_rank}" if r.powersgd_rank else ""
                    print(f"[{time.perf_counter() - t_job:8.1f}s] {size} ({res['size_label']}, "
                          f"{r.steps} steps) {r.group}{extra} lr {r.lr:g} seed {r.seed}: val "
                          f"{res['final_val_loss']:.4f}  {res['tokens_per_second']:.0f} tok/s "
                          f"{res['bytes_per_step']:,.0f} B/step  identical "
                          f"{res['ranks_identical']}", flush=True)
        self.dist.destroy_process_group()
        self.comm.destroy()
        if not ok:
            print("FAILED: ranks diverged", file=sys.stderr)
        return 0 if ok else 1


def _git() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=20, cwd=HERE).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def dry_run(args: argparse.Namespace) -> int:
    """The plan's sizes, steps and run count, and (with --step-seconds) its cost."""
    plan = PLANS[args.plan]
    if args.sizes:
        plan.sizes = list(args.sizes)
    if args.peers is not None:
        plan.peers = list(args.peers)
    if args.tokens_per_param:
        plan.tokens_per_param = args.tokens_per_param
    if args.seeds:
        plan.seeds = args.seeds
    world = args.world
    sch = Schedule(plan, world, True)
    per = {k: float(v) for k, v in (x.split("=") for x in args.step_seconds)}
    # CPU seconds (all ranks) of one run, measured: the median of OUT's recorded runs of the
    # same size, steps and world size (the whole plan's cost, done or not)
    measured: Dict[Tuple[str, int], List[float]] = {}
    for r in read_runs(os.path.join(args.out, "runs.jsonl")):
        if r.get("world_size") == world and r.get("cpu_seconds_all_ranks"):
            measured.setdefault((r["size"], r["steps"]), []).append(r["cpu_seconds_all_ranks"])
    total = cpu_total = 0.0
    for size in plan.sizes:
        n = n_params(size, plan.context)
        steps, batch = sch.steps(size)
        swept = plan.swept or SWEPT
        peers = PEERS if plan.peers is None else plan.peers
        variants = VARIANTS if plan.variants is None else plan.variants
        if plan.lr_plan:  # the axes: no sweep, every seed at the sweep plan's lr, the re-check
            runs = (plan.seeds + len(plan.lr_check)) * len(swept)
        else:
            runs = (sum(len(plan.group_grids.get(g) or plan.grids[CONFIGS[g]["sweep"]])
                        for g in swept) + (plan.seeds - 1) * len(swept))
        runs += plan.seeds * len(peers) + (plan.variant_seeds or plan.seeds) * len(variants)
        if plan.repeats:  # the rest are plan.repeats's runs
            runs = (plan.variant_seeds or plan.seeds) * len(variants)
        sec = per.get(size, float("nan")) * steps * runs
        total += sec if sec == sec else 0.0
        got = sorted(measured.get((size, steps), []))
        cpu = got[len(got) // 2] * runs if got else float("nan")
        cpu_total += cpu if cpu == cpu else 0.0
        shapes = param_shapes(size, plan.context)
        psgd1 = powersgd_bytes_per_step(shapes, 1, steps, world)
        print(f"{size:8s} {size_label(n):>14s} {n:>10,d} params  {steps:6d} steps x {batch} "
              f"seq/rank ({steps * batch * plan.context * world / n:.1f} tokens/param)  {runs} "
              f"runs (no grid extension)  est {sec / 60:6.1f} min  "
              f"{cpu / 3600:5.2f} CPU-h ({len(got)} recorded)  PowerSGD rank 1 "
              f"{psgd1:,.0f} B/step")
    print(f"total estimate {total / 60:.1f} min (--step-seconds), {cpu_total / 3600:.2f} CPU-hours "
          f"(the median recorded run in {args.out} x the runs)")
    return 0


def arg_parser() -> argparse.ArgumentParser:
    """The command line of this script; also what other scripts (perf/cluster/bench.py) build
    a Study's arguments from, so that an option added here reaches them with its default."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", choices=sorted(PLANS), default="smoke")
    ap.add_argument("--out", default=os.path.join(HERE, "out-scaling"))
    ap.add_argument("--sizes", nargs="*", choices=sorted(SIZES), help="sizes of the plan to run")
    ap.add_argument("--seeds", type=int, default=0)
    ap.add_argument("--peers", nargs="*", choices=sorted(CONFIGS), default=None,
                    help="the peers to run instead of the plan's (none: --peers alone)")
    ap.add_argument("--lrcheck-seeds", type=int, default=0,
                    help="seeds of the axes' lr re-check (default 1); with --only and "
                         "--lrcheck-factors, the 3 seeds of a moved lr")
    ap.add_argument("--lrcheck-factors", type=float, nargs="*", default=None,
                    help="the re-check's factors of the reported lr (default the plan's)")
    ap.add_argument("--tokens-per-param", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=0, help="fixed steps (timing runs)")
    ap.add_argument("--lr", type=float, default=0.0, help="one lr for every sweep (timing runs)")
    ap.add_argument("--only", nargs="*", choices=sorted(CONFIGS),
                    help="run only these configurations (timing runs)")
    ap.add_argument("--variant-lr-scale", type=float, default=0.0,
                    help="run the variants at their method's best lr times this")
    ap.add_argument("--variant-seeds", type=int, default=0,
                    help="seeds of each variant (default: the plan's; q20 screens with 2)")
    ap.add_argument("--sweep-only", action="store_true",
                    help="only the sweep stage (timing runs)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--world", type=int, default=4, help="ranks assumed by --dry-run")
    ap.add_argument("--step-seconds", nargs="*", default=[],
                    help="SIZE=SECONDS per training step, for --dry-run's estimate")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = arg_parser().parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device).index or
                              int(os.environ.get("LOCAL_RANK", "0")))
        args.device = f"cuda:{torch.cuda.current_device()}"
    return Study(args).main()


if __name__ == "__main__":
    sys.exit(main())
