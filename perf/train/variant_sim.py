"""A single-process simulation of the SCAPE-AdamS step on P ranks, to try variants of the
algorithm (issue 23 item 3) before anyone puts them in the library.

This is NOT the library: it re-implements the step of docs/ALGORITHM.md sections 3-4 in torch
(fp32, one process, CPU), with per-rank gradients from each rank's own data shard, the model,
corpus, token budget, lr schedule, betas, weight decay and clipping of perf/train/scaling.py's
`cpu` plan. Its default (`--variant paper`) is the paper's algorithm as the library implements
it in replicated mode with segment ownership (ScapeAdamS's defaults): step 0 dense; the mask
used at step t is chosen at step t-1 at the warm-up density rho(t) = rho^(t/W) (W = 10% of the
steps); for each tensor, the rank that owns it (largest tensor first to the least-loaded rank)
picks the top-k of |its own candidate|, k = max(1, floor(rho * len)); 1-D tensors always
dense; the payload is the rank average of c_r = b1*m + (1-b1)*g_r + e_r at the mask; e_r = c_r
outside it, 0 at it; m = 0 outside it; recovered gradient, global-norm clipping with the
momentum rebuilt, AdamS update without bias correction, decoupled weight decay everywhere.
`--variant adams` is the same at density 1 (dense AdamS). The variants change the arithmetic
only: every one sends the paper's bytes (the same mask size, values only) and uses only values
identical on every rank wherever the parameters and momentum are written, so each could be a
library option; the simulation itself does not check bits across ranks (one process).

Every finished run is one JSON line of OUT/runs.jsonl, keyed by size, variant, density, peak lr,
seed, steps, batch and ranks (a variant fixes its warm-up); a key already there is skipped
(resumable). perf/RESULTS_training.md ("Variant search (simulation)") has the results.
Examples:

    /usr/bin/python3 perf/train/variant_sim.py --size d48L2 --variant paper --density 0.01 \\
        --lr 0.0333 --seeds 1 2
    /usr/bin/python3 perf/train/variant_sim.py --size d16L1 --steps 20 --smoke
    /usr/bin/python3 perf/train/variant_sim.py --list        # the variants and what they do
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import data  # noqa: E402
import model as gpt  # noqa: E402

# The study's constants (perf/train/train.py and scaling.py), repeated here so the simulation
# does not import the library's Python package.
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.01
CLIP = 1.0
LR_WARMUP_FRAC = 0.05
DENSITY_WARMUP_FRAC = 0.1
ENTER_CAP = 100.0          # kernels::kEnterCap: |update| <= 100 lr for an entering coordinate
SIZES: Dict[str, Tuple[int, int, int]] = {
    "d16L1": (16, 1, 2), "d24L1": (24, 1, 2), "d24L2": (24, 2, 2), "d32L2": (32, 2, 4),
    "d48L2": (48, 2, 4), "d64L2": (64, 2, 4), "d96L3": (96, 3, 4), "d128L4": (128, 4, 4),
}
CONTEXT = 64
TOKENS_PER_PARAM = 2.0
TARGET_STEPS = 240
MIN_STEPS = 100

# variant name -> (option overrides, one line of what it does)
VARIANTS: Dict[str, Tuple[Dict[str, Any], str]] = {
    "paper": ({}, "the paper's algorithm, as the library's default"),
    "adams": ({"dense": True}, "dense AdamS (density 1, no warm-up)"),
    "paper-rnd": ({"avg64": True},
                  "the paper's algorithm with the rank average summed in fp64 (a rounding-level "
                  "change: measures how far rounding alone moves a run)"),
    "adams-rnd": ({"dense": True, "avg64": True}, "dense AdamS, the average summed in fp64"),
    "segrms": ({"entering": "segment_rms"},
               "entering coordinate's denominator from its segment's staying RMS (ALGORITHM 4.13)"),
    "enter-v": ({"entering": "stored_v"},
                "entering coordinate's denominator from a stored per-coordinate second moment "
                "(EMA b2 of the clipped recovered gradient at staying coordinates; 4 B/param)"),
    "enter-vfrz": ({"entering": "stored_v", "v_freeze": True},
                   "as enter-v, the stored second moment frozen after the density warm-up"),
    "denom-v": ({"denom": "stored_v"},
                "every masked coordinate divides by the stored second moment (lazy Adam v; "
                "staying coordinates update it, 0/1 Adam-like)"),
    "denom-vfrz": ({"denom": "stored_v", "v_freeze": True},
                   "every masked coordinate divides by a second moment frozen after the density "
                   "warm-up (1-bit Adam)"),
    "leave-drop": ({"leaving": "drop"},
                   "control: a leaving coordinate's b1*m is dropped (not kept in the residual)"),
    "leave-decay": ({"leaving": "decay", "entering": "stored_v"},
                    "a leaving coordinate keeps its momentum locally, decaying by b1 and still "
                    "moving theta by lr*m/sqrt(v_stored); its b1*m is kept out of the residual "
                    "(needs the stored v; entering as enter-v)"),
    "ef-decay": ({"e_decay": 0.95},
                 "DeMo-like: the residual decays by 0.95 per step (stale mass forgotten)"),
    "ef-decay99": ({"e_decay": 0.99}, "as ef-decay with 0.99"),
    "dgc-vel": ({"dgc": True},
                "DGC momentum correction: each rank keeps a local velocity u_r = b1*u_r + g_r "
                "outside the mask, the residual accumulates (1-b1)*u_r, both zeroed at the mask "
                "(momentum factor masking; 4 B/param per rank)"),
    "segrms-fm": ({"entering": "segment_rms", "enter_mom": "clamp"},
                  "segrms + momentum factor masking adapted to AdamS (issue 30, 3b): the entering "
                  "step moves the coordinate by its whole residual (segment_rms), then the "
                  "momentum it keeps is clamped to one step's worth at the segment's scale, "
                  "|m| <= (1-b1)*clip*sqrt(V_s), so the delivered mass does not push again"),
    "fm": ({"enter_mom": "clamp_payload"},
           "the paper's entering step, then the same clamp of the kept momentum (control: "
           "there the kept momentum is what delivers the residual over the next steps)"),
    "wu0": ({"warmup_frac": 0.0}, "no density warm-up"),
    "wu0.3": ({"warmup_frac": 0.3}, "density warm-up over 30% of the steps"),
    "segrms-wu0.3": ({"entering": "segment_rms", "warmup_frac": 0.3}, "segrms + wu0.3"),
    "enter-v-wu0.3": ({"entering": "stored_v", "warmup_frac": 0.3}, "enter-v + wu0.3"),
}
DEFAULTS: Dict[str, Any] = dict(dense=False, entering="payload", denom="adams",
                                leaving="residual", v_freeze=False, e_decay=1.0, dgc=False,
                                warmup_frac=DENSITY_WARMUP_FRAC, avg64=False, enter_mom="keep")


def model_config(size: str) -> gpt.GPTConfig:
    d, n_layers, heads = SIZES[size]
    return gpt.GPTConfig(vocab=data.VOCAB, context=CONTEXT, d_model=d, n_layers=n_layers,
                         n_heads=heads)


def plan_steps(n_params: int, world: int) -> Tuple[int, int]:
    """(steps, sequences per rank per step): scaling.py's Schedule.steps for the `cpu` plan."""
    tokens = TOKENS_PER_PARAM * n_params
    seq = world * CONTEXT
    b = max(1, int(round(tokens / (seq * TARGET_STEPS))))
    return max(MIN_STEPS, int(round(tokens / (seq * b)))), b


def lr_at(step: int, steps: int, peak: float) -> float:
    w = max(1, int(LR_WARMUP_FRAC * steps))
    if step < w:
        return peak * (step + 1) / w
    t = (step - w) / max(1, steps - w)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def owners(lengths: List[int], world: int) -> List[int]:
    """Segment ownership as plugin/mask/mask.cc builds it: largest segment first (stable), each
    to the least-loaded rank (ties: lower rank)."""
    order = sorted(range(len(lengths)), key=lambda s: -lengths[s])
    load = [0] * world
    own = [0] * len(lengths)
    for s in order:
        if lengths[s] == 0:
            continue
        best = min(range(world), key=lambda r: (load[r], r))
        load[best] += lengths[s]
        own[s] = best
    return own


class SimStep:
    """The SCAPE-AdamS step on P simulated ranks, replicated state, flat fp32 buffers."""

    def __init__(self, theta: torch.Tensor, lengths: List[int], dense: List[bool], world: int,
                 density: float, warmup_steps: int, opt: Dict[str, Any]) -> None:
        n = theta.numel()
        self.theta, self.world, self.n = theta, world, n
        self.opt = opt
        self.density = 1.0 if opt["dense"] else density
        self.warmup = 0 if opt["dense"] else warmup_steps
        self.offs = [0]
        for ln in lengths:
            self.offs.append(self.offs[-1] + ln)
        self.lengths, self.dense = lengths, dense
        self.own = owners(lengths, world)
        self.seg_id = torch.zeros(n, dtype=torch.long)
        for s, (a, b) in enumerate(zip(self.offs[:-1], self.offs[1:])):
            self.seg_id[a:b] = s
        self.m = torch.zeros(n)
        self.e = torch.zeros(world, n)
        self.cur = torch.ones(n, dtype=torch.bool)     # step 0 is dense
        self.prev = torch.zeros(n, dtype=torch.bool)   # the mask of the previous step
        need_v = opt["entering"] == "stored_v" or opt["denom"] == "stored_v" or \
            opt["leaving"] == "decay"
        self.v = torch.zeros(n) if need_v else None
        self.u = torch.zeros(world, n) if opt["dgc"] else None
        self.t = 0
        self.mask_counts: List[int] = []
        self.turnover: List[float] = []
        self.enter_moves: List[float] = []

    def density_at(self, t: int) -> float:
        if t <= 0:
            return 1.0
        if self.warmup > 0 and t < self.warmup:
            return self.density ** (t / self.warmup)
        return self.density

    def select(self, C: torch.Tensor, rho: float) -> torch.Tensor:
        nxt = torch.zeros(self.n, dtype=torch.bool)
        for s, (a, b) in enumerate(zip(self.offs[:-1], self.offs[1:])):
            if b == a:
                continue
            if self.dense[s] or rho >= 1.0:
                nxt[a:b] = True
                continue
            k = max(1, int(math.floor(rho * (b - a))))
            idx = torch.topk(C[self.own[s], a:b].abs(), k, sorted=False).indices
            nxt[a + idx] = True
        return nxt

    def staying_mean_sq(self, gh: torch.Tensor, stay: torch.Tensor,
                        cur: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per masked coordinate: its segment's mean of gh^2 over the staying coordinates
        (V_s of ALGORITHM 4.13, summed in fp64) and the segment's count of them."""
        segc = self.seg_id[cur]
        nseg = len(self.lengths)
        sq = torch.zeros(nseg, dtype=torch.float64).index_add_(
            0, segc, torch.where(stay, gh * gh, torch.zeros(())).double())
        cnt = torch.zeros(nseg, dtype=torch.float64).index_add_(0, segc, stay.double())
        return (sq / cnt.clamp(min=1)).float()[segc], cnt[segc]

    def step(self, G: torch.Tensor, lr: float) -> None:
        o = self.opt
        b1, b2 = BETAS
        cur, mp = self.cur, self.m
        enter = cur & (mp == 0) if o["leaving"] != "decay" else cur & ~self.prev
        if self.t == 0:
            enter = cur.clone()
        # candidate (dense, per rank)
        if o["dgc"]:
            # DGC: local velocity outside the mask; the residual integrates it
            self.u = b1 * self.u + G
            C = b1 * mp + (1 - b1) * torch.where(cur, G, self.u) + self.e
        else:
            C = b1 * mp + (1 - b1) * G + self.e
        nxt = self.select(C, self.density_at(self.t + 1))
        # the exchange: the rank average at the current mask
        mt = C[:, cur].double().mean(0).float() if o["avg64"] else C[:, cur].mean(0)
        # residual: c outside the mask, 0 at it
        out = ~cur
        keep = C
        if o["leaving"] in ("drop", "decay"):
            keep = C - b1 * mp          # a leaving coordinate's b1*m is not kept
        self.e = torch.where(out, keep, torch.zeros(()))
        if o["e_decay"] != 1.0:
            self.e *= o["e_decay"]
        if o["dgc"]:
            self.u = torch.where(out, self.u, torch.zeros(()))
        # recovery and clipping
        mpc = mp[cur]
        gh = (mt - b1 * mpc) / (1 - b1)
        norm = float(gh.double().pow(2).sum().sqrt())
        clip = min(1.0, CLIP / (norm + 1e-6)) if math.isfinite(norm) else 1.0
        g = gh * clip
        mn = b1 * mpc + (1 - b1) * g
        v = b2 * mpc * mpc + (1 - b2) * g * g
        upd = lr * mn / (v.sqrt() + EPS)
        ent = enter[cur]
        stay = ~ent
        if self.v is not None:
            # the stored second moment: the true (clipped) gradient at step 0, then an EMA over
            # the staying coordinates (an entering coordinate's g^ carries its residual)
            vs = self.v[cur]
            frozen = o["v_freeze"] and self.t >= max(1, self.warmup)
            if self.t == 0:
                vs = g * g
            elif not frozen:
                vs = torch.where(stay, b2 * vs + (1 - b2) * g * g, vs)
            self.v[cur] = vs
        if o["denom"] == "stored_v":
            ok = vs > 0
            upd = torch.where(ok, lr * mn / (vs.sqrt() + EPS), upd)
        if self.t > 0 and o["entering"] == "segment_rms":
            V, n_stay = self.staying_mean_sq(gh, stay, cur)
            okv = (n_stay > 0) & torch.isfinite(V) & (V > 0)
            u2 = (lr * mn / ((clip * clip * V).sqrt() + EPS)).clamp(-ENTER_CAP * lr,
                                                                    ENTER_CAP * lr)
            upd = torch.where(ent & okv, u2, upd)
            if o["enter_mom"] == "clamp":
                cap = (1 - b1) * clip * V.sqrt()
                mn = torch.where(ent & okv, torch.maximum(torch.minimum(mn, cap), -cap), mn)
        elif self.t > 0 and o["entering"] == "stored_v" and o["denom"] != "stored_v":
            okv = vs > 0
            u2 = (lr * mn / (vs.sqrt() + EPS)).clamp(-ENTER_CAP * lr, ENTER_CAP * lr)
            upd = torch.where(ent & okv, u2, upd)
        if self.t > 0 and o["enter_mom"] == "clamp_payload":
            V, n_stay = self.staying_mean_sq(gh, stay, cur)
            cap = (1 - b1) * clip * V.sqrt()
            okc = (n_stay > 0) & (cap > 0)
            mn = torch.where(ent & okc, torch.maximum(torch.minimum(mn, cap), -cap), mn)
        if self.t > 0 and ent.any():
            self.enter_moves.append(float((upd[ent].abs() / lr).median()))
        # the update: decay everywhere, the step at the mask
        self.theta.mul_(1 - lr * WEIGHT_DECAY)
        th = self.theta[cur] - upd
        self.theta[cur] = th
        newm = torch.zeros(self.n)
        if o["leaving"] == "decay":
            # outside the mask the (replicated) momentum decays locally and keeps moving theta
            vo = self.v[out]
            mo = b1 * mp[out]
            mo = torch.where(vo > 0, mo, torch.zeros(()))
            self.theta[out] -= lr * mo / (vo.sqrt() + EPS)
            newm[out] = mo
        newm[cur] = mn
        self.m = newm
        k = int(cur.sum())
        self.mask_counts.append(k)
        if self.t > 0:
            self.turnover.append(float((cur & ~self.prev).sum()) / max(1, k))
        self.prev = cur
        self.cur = nxt
        self.t += 1


def evaluate(m: torch.nn.Module, windows: np.ndarray) -> float:
    val = torch.from_numpy(windows)
    tot, cnt = 0.0, 0
    with torch.no_grad():
        m.eval()
        for i in range(0, len(val), 32):
            w = val[i:i + 32]
            tot += float(m(w[:, :-1], w[:, 1:])) * len(w)
            cnt += len(w)
        m.train()
    return tot / cnt


def run_key(r: Dict[str, Any]) -> str:
    return (f"{r['size']}|{r['variant']}|d{r['density']:g}|lr{r['lr']:g}|s{r['seed']}"
            f"|n{r['steps']}|b{r['batch']}|w{r['world']}")


def run(size: str, variant: str, density: float, lr: float, seed: int, world: int,
        steps: Optional[int], batch: Optional[int], corpus: data.Corpus,
        evals: int = 4, eval_windows: int = 256, final_windows: int = 1024) -> Dict[str, Any]:
    opt = dict(DEFAULTS)
    opt.update(VARIANTS[variant][0])
    cpu0, wall0 = time.process_time(), time.perf_counter()
    torch.manual_seed(seed)
    m = gpt.GPT(model_config(size))
    params = list(m.parameters())
    n = sum(p.numel() for p in params)
    st, b = plan_steps(n, world)
    steps = steps or st
    batch = batch or b
    theta = torch.cat([p.detach().reshape(-1) for p in params])
    off = 0
    for p in params:  # the parameters become views of the flat buffer, as in ScapeAdamS
        p.data = theta[off:off + p.numel()].view_as(p)
        off += p.numel()
    lengths = [p.numel() for p in params]
    dense = [p.dim() <= 1 for p in params]
    sim = SimStep(theta, lengths, dense, world, density,
                  int(opt["warmup_frac"] * steps), opt)
    streams = [data.encode(data.rank_shard(corpus.train_docs, r, world)) for r in range(world)]
    batches = [data.Batches(streams[r], CONTEXT, batch, seed=seed * 1000 + r)
               for r in range(world)]
    val_stream = data.encode(corpus.val_docs)
    win_mid = data.eval_windows(val_stream, CONTEXT, eval_windows)
    win_fin = data.eval_windows(val_stream, CONTEXT, final_windows)
    eval_at = sorted({int(round(i * steps / evals)) for i in range(evals + 1)})
    curve = []
    G = torch.zeros(world, n)
    loss_val = float("nan")
    for step in range(steps + 1):
        if step in eval_at:
            v = evaluate(m, win_fin if step == steps else win_mid)
            curve.append({"step": step, "val_loss": v,
                          "train_loss": loss_val if step else None})
        if step == steps:
            break
        losses = []
        for r in range(world):
            x, y = batches[r].next()
            for p in params:
                p.grad = None
            loss = m(torch.from_numpy(x), torch.from_numpy(y))
            loss.backward()
            losses.append(float(loss))
            G[r] = torch.cat([p.grad.reshape(-1) for p in params])
        loss_val = float(np.mean(losses))
        sim.step(G, lr_at(step, steps, lr))
    k = np.array(sim.mask_counts, dtype=np.float64)
    return {
        "size": size, "variant": variant, "options": opt, "density": density if not opt["dense"]
        else 1.0, "lr": lr, "seed": seed, "steps": steps, "batch": batch, "world": world,
        "params": n, "warmup_steps": sim.warmup, "final_val_loss": curve[-1]["val_loss"],
        "curve": curve, "avg_mask_fraction": float(k.mean() / n),
        "payload_values_per_step": float(k.mean()),
        "median_turnover": float(np.median(sim.turnover)) if sim.turnover else 0.0,
        "median_enter_move_over_lr": float(np.median(sim.enter_moves)) if sim.enter_moves
        else None,
        "finite": bool(math.isfinite(curve[-1]["val_loss"])),
        "cpu_seconds": time.process_time() - cpu0, "wall_seconds": time.perf_counter() - wall0,
        "torch": torch.__version__, "simulation": True,
    }


def read_runs(path: str) -> List[Dict[str, Any]]:
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    if line.strip():
                        out.append(json.loads(line))
                except ValueError:
                    print(f"{path}: skipping a damaged line", file=sys.stderr)
    return out


def append(path: str, res: Dict[str, Any]) -> None:
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(res) + "\n").encode())


def self_test(corpus: data.Corpus) -> int:
    """The smoke check (ctest VariantSim.SelfTest): at the smallest size, 20 steps, the default
    runs and its loss is finite and falls; at density 1 the sparse machinery gives dense AdamS's
    loss exactly; at density 0.01 the mask is sparse and an entering coordinate moves
    (1-b1)/sqrt(1-b2) lr (the diagnosis of ALGORITHM.md 4.13); segment_rms changes that."""
    kw = dict(evals=2, eval_windows=16, final_windows=32)
    fails = []

    def go(v: str, d: float) -> Dict[str, Any]:
        return run("d16L1", v, d, 0.01, 1, 4, 20, 2, corpus, **kw)

    paper, dense1, adams, seg = go("paper", 0.01), go("paper", 1.0), go("adams", 1.0), \
        go("segrms", 0.01)
    c = paper["curve"]
    if not (paper["finite"] and c[-1]["val_loss"] < c[0]["val_loss"] - 0.3):
        fails.append(f"paper: loss did not fall: {[x['val_loss'] for x in c]}")
    if dense1["final_val_loss"] != adams["final_val_loss"]:
        fails.append(f"density 1 {dense1['final_val_loss']} != dense AdamS "
                     f"{adams['final_val_loss']}")
    if not paper["avg_mask_fraction"] < 0.5:
        fails.append(f"mask fraction {paper['avg_mask_fraction']}")
    want = (1 - BETAS[0]) / math.sqrt(1 - BETAS[1])
    if abs(paper["median_enter_move_over_lr"] - want) > 1e-3:
        fails.append(f"entering move {paper['median_enter_move_over_lr']} != {want}")
    if abs(seg["median_enter_move_over_lr"] - want) < 1e-2 or not seg["finite"]:
        fails.append(f"segment_rms entering move {seg['median_enter_move_over_lr']}")
    for f in fails:
        print("FAIL:", f)
    print("self-test", "failed" if fails else "passed", flush=True)
    return 1 if fails else 0


def summary(path: str) -> str:
    """A markdown table of runs.jsonl: per size, density, variant and lr, the seeds' final
    validation losses and the gap to the simulation's dense AdamS (its best lr, mean over the
    seeds it shares)."""
    runs = read_runs(path)
    groups: Dict[Tuple[str, float, str, float], Dict[int, float]] = {}
    for r in runs:
        groups.setdefault((r["size"], r["density"], r["variant"], r["lr"]), {})[r["seed"]] = \
            r["final_val_loss"]
    lines = ["| size | density | variant | peak lr | seeds | final val loss per seed | mean "
             "| gap to dense AdamS, seeds 1-2 | gap, all seeds (if more) |",
             "|---|---|---|---|---|---|---|---|---|"]
    ref: Dict[str, Dict[int, float]] = {}
    for (size, d, v, lr), by in groups.items():
        if v == "adams":
            best = ref.get(size)
            if best is None or np.mean(list(by.values())) < np.mean(list(best.values())):
                ref[size] = by

    def gap(size: str, by: Dict[int, float], seeds: List[int]) -> str:
        common = [s for s in seeds if s in ref.get(size, {})]
        if not common:
            return ""
        a = np.mean([ref[size][s] for s in common])
        b = np.mean([by[s] for s in common])
        return f"{100 * (b / a - 1):+.1f}% ({len(common)})"

    for (size, d, v, lr), by in sorted(groups.items(), key=lambda x: (x[0][0], -x[0][1],
                                                                      x[0][2], x[0][3])):
        seeds = sorted(by)
        mean = float(np.mean([by[s] for s in seeds]))
        g12 = gap(size, by, [s for s in seeds if s <= 2])
        gall = gap(size, by, seeds) if len(seeds) > 2 else ""
        lines.append(f"| {size} | {d:g} | {v} | {lr:.3g} | {len(seeds)} | "
                     f"{', '.join(f'{by[s]:.4f}' for s in seeds)} | {mean:.4f} | {g12} | "
                     f"{gall} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="d48L2", choices=sorted(SIZES))
    ap.add_argument("--variant", nargs="*", default=["paper"])
    ap.add_argument("--density", nargs="*", type=float, default=[0.01])
    ap.add_argument("--lr", nargs="*", type=float, default=[0.01])
    ap.add_argument("--seeds", nargs="*", type=int, default=[1])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=0, help="override the plan's steps")
    ap.add_argument("--batch", type=int, default=0, help="override the plan's sequences/rank")
    ap.add_argument("--final-windows", type=int, default=1024,
                    help="validation windows of the final evaluation (train.py's plan full: 256)")
    ap.add_argument("--out", default=os.path.join(HERE, "out-variants"))
    ap.add_argument("--smoke", action="store_true",
                    help="few evaluation windows, write nothing, fail on a non-finite loss")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--self-test", action="store_true", help="the ctest smoke check")
    ap.add_argument("--summary", action="store_true", help="print OUT/runs.jsonl as a table")
    args = ap.parse_args(argv)
    if args.summary:
        print(summary(os.path.join(args.out, "runs.jsonl")))
        return 0
    if args.list:
        for k, (o, what) in VARIANTS.items():
            print(f"{k:14s} {what}  {o}")
        return 0
    for v in args.variant:
        if v not in VARIANTS:
            ap.error(f"--variant {v!r}: not one of {', '.join(VARIANTS)}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    corpus = data.load()
    if args.self_test:
        return self_test(corpus)
    path = os.path.join(args.out, "runs.jsonl")
    done = set()
    if not args.smoke:
        os.makedirs(args.out, exist_ok=True)
        done = {run_key(r) for r in read_runs(path)}
    ok = True
    for v in args.variant:
        dens = [1.0] if VARIANTS[v][0].get("dense") else args.density
        for d in dens:
            for lr in args.lr:
                for s in args.seeds:
                    n = sum(p.numel() for p in gpt.GPT(model_config(args.size)).parameters())
                    steps = args.steps or plan_steps(n, args.world)[0]
                    batch = args.batch or plan_steps(n, args.world)[1]
                    key = run_key(dict(size=args.size, variant=v, density=d, lr=lr, seed=s,
                                       steps=steps, batch=batch, world=args.world))
                    if key in done:
                        continue
                    kw = dict(evals=2, eval_windows=16, final_windows=32) if args.smoke else \
                        dict(final_windows=args.final_windows)
                    res = run(args.size, v, d, lr, s, args.world, args.steps or None,
                              args.batch or None, corpus, **kw)
                    res["key"] = key
                    ok = ok and res["finite"]
                    print(f"{key}: val {res['final_val_loss']:.4f} mask "
                          f"{res['avg_mask_fraction']:.4f} turnover {res['median_turnover']:.2f}"
                          f" enter-move/lr {res['median_enter_move_over_lr']} "
                          f"cpu {res['cpu_seconds']:.1f}s", flush=True)
                    if not args.smoke:
                        append(path, res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
