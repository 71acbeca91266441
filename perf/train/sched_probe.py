"""Why a short density warm-up costs SCAPE 0.01 against none (issue 42 item 3, the second half).

The setting of the issue: the GPT-2-shaped Hugging Face model of examples/tiny_gpt2.py (2
layers, width 64, 2 heads) with the fortunes corpus's byte vocabulary (257) and context 64
(about 120k parameters), 2 ranks, 16 sequences per rank per step, 1000 steps, peak lr 3e-3 with
Hugging Face Trainer's defaults as a new user gets them through scape.integrations.hf (cosine
decay to 0 without lr warm-up, betas (0.9, 0.999), eps 1e-8, weight decay 0, max_grad_norm 1
on the recovered gradient). The step is perf/train/variant_sim.py's SimStep (the library's
algorithm re-implemented in torch on P simulated ranks, one process; NOT the library), with
the density schedule of scape.h's scapeDensitySchedule_t, and it measures over the run:

- |e|: the L2 norm of the residual (mean over ranks) and, of it, the part that coordinates
  leaving the mask deposited as b1*m (tracked apart: the deposit, zeroed where the coordinate
  is in the mask again, as the residual is);
- resid_driven: of the positions the top-k picks for the next mask (sparse segments), the
  fraction whose owner's |e| is larger than its fresh part |b1*m + (1-b1)*g|;
- turnover (entering positions / masked), the clip factor of the recovered gradient and, of
  its squared norm, the share the entering coordinates carry.

Each run is one JSON line of OUT/probe.jsonl keyed by schedule, fix, density, seed (resumable):

    nice -n 10 /usr/bin/python3 perf/train/sched_probe.py --schedule geometric --warmup 100 \\
        --seeds 1 2
    /usr/bin/python3 perf/train/sched_probe.py --summary
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Dict, List

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import data  # noqa: E402
import variant_sim as vs  # noqa: E402

CONTEXT = 64
BATCH = 16
WORLD = 2
STEPS = 1000
LR = 3e-3
# Hugging Face TrainingArguments' defaults, as ScapeTrainer passes them on
HF_BETAS = (0.9, 0.999)
HF_CLIP = 1.0
# fixes tried (SimStep options, variant_sim.py's names)
FIXES: Dict[str, Dict[str, Any]] = {
    "none": {},
    "leave-drop": {"leaving": "drop"},
    "ef-decay": {"e_decay": 0.95},
    "segrms": {"entering": "segment_rms"},
}


def density_at(schedule: str, rho: float, w: int, t: int) -> float:
    """rho(t) of scape.h's scapeDensitySchedule_t (the library computes the same in
    plugin/optim/optim.cc: ScheduleDensity)."""
    if t <= 0:
        return 1.0
    if w <= 0 or t >= w:
        return rho
    x = t / w
    if schedule == "linear":
        return 1.0 - (1.0 - rho) * x
    return rho ** x


class ProbeStep(vs.SimStep):
    def __init__(self, *a: Any, schedule: str = "geometric", **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.schedule = schedule
        self.dep = torch.zeros(self.world, self.n)  # the leaving-momentum part of the residual
        owner = torch.tensor(self.own, dtype=torch.long)[self.seg_id]
        self.owner = owner
        sparse = torch.ones(self.n, dtype=torch.bool)
        for s, (a0, b0) in enumerate(zip(self.offs[:-1], self.offs[1:])):
            if self.dense[s]:
                sparse[a0:b0] = False
        self.sparse = sparse
        self.rows: List[Dict[str, float]] = []
        self.theta_init = self.theta.clone()

    def density_at(self, t: int) -> float:
        return density_at(self.schedule, self.density, self.warmup, t)

    def step(self, G: torch.Tensor, lr: float) -> None:
        b1 = vs.BETAS[0]
        mp, cur = self.m, self.cur
        fresh = b1 * mp + (1 - b1) * G
        e_before = self.e.clone()
        leaving_dep = torch.where(~cur & (mp != 0), b1 * mp, torch.zeros(()))
        t = self.t
        # the recovered gradient's norm and clip factor, and the entering coordinates' share of
        # its square (as SimStep computes them)
        C = fresh + self.e
        gh = (C[:, cur].mean(0) - b1 * mp[cur]) / (1 - b1)
        ent_c = (mp[cur] == 0) if t else torch.ones_like(gh, dtype=torch.bool)
        n2 = float(gh.double().pow(2).sum())
        clip = min(1.0, vs.CLIP / (math.sqrt(n2) + 1e-6))
        enter_share = float(gh[ent_c].double().pow(2).sum()) / max(n2, 1e-30)
        theta0 = self.theta.clone()
        super().step(G, lr)
        move = float((self.theta - theta0).norm()) / max(lr, 1e-30)
        # the deposit bookkeeping: what left now joins, everything in the mask now is spent
        self.dep = torch.where(cur, torch.zeros(()), self.dep + leaving_dep)
        if self.opt.get("leaving") == "drop":
            self.dep.zero_()
        elif self.opt.get("e_decay", 1.0) != 1.0:
            self.dep *= self.opt["e_decay"]
        if t % 5 and t > 5:
            return
        nxt = self.cur & self.sparse
        idx = torch.nonzero(nxt).squeeze(1)
        own = self.owner[idx]
        e_sel = e_before[own, idx].abs()
        f_sel = fresh[own, idx].abs()
        ent = cur & (mp == 0) if t else cur
        g_norm2 = None
        row = {"step": t, "density": float(self.density_at(t)),
               "e_norm": float(self.e.norm(dim=1).mean()),
               "dep_norm": float(self.dep.norm(dim=1).mean()),
               "g_norm": float(((1 - b1) * G).norm(dim=1).mean()),
               "resid_driven": float((e_sel > f_sel).double().mean()) if len(idx) else 0.0,
               "turnover": float((ent & self.sparse).sum()) / max(1, int((cur & self.sparse).sum())),
               }
        del g_norm2
        row.update(clip=clip, enter_share=enter_share, move_over_lr=move,
                   # how far the parameters are from their initial values, relative, and the
                   # fraction of the coordinates that have moved at all
                   drift=float((self.theta - self.theta_init).norm() / self.theta_init.norm()),
                   moved=float((self.theta != self.theta_init).double().mean()))
        self.rows.append(row)


def hf_model(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=data.VOCAB, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=data.SEP,
                     eos_token_id=data.SEP)
    return GPT2LMHeadModel(cfg)


def lr_cosine(step: int, steps: int, peak: float, warmup: int = 0) -> float:
    """transformers.get_cosine_schedule_with_warmup (Trainer's lr_scheduler_type='cosine';
    warmup_steps 0 by default): linear from 0 over `warmup` steps, then cosine to 0."""
    if step < warmup:
        return peak * step / max(1, warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def loss_of(m: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> torch.Tensor:
    logits = m(input_ids=torch.from_numpy(x)).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.from_numpy(y).reshape(-1))


def evaluate(m: torch.nn.Module, windows: np.ndarray) -> float:
    tot, cnt = 0.0, 0
    with torch.no_grad():
        m.eval()
        for i in range(0, len(windows), 64):
            w = windows[i:i + 64]
            tot += float(loss_of(m, w[:, :-1], w[:, 1:])) * len(w)
            cnt += len(w)
        m.train()
    return tot / cnt


def key(r: Dict[str, Any]) -> str:
    lw = f"|lw{r['lr_warmup']}" if r.get("lr_warmup") else ""
    return (f"{r['schedule']}|w{r['warmup']}|{r['fix']}|d{r['density']:g}|lr{r['lr']:g}{lw}"
            f"|s{r['seed']}|n{r['steps']}")


def run(schedule: str, warmup: int, fix: str, density: float, seed: int, steps: int, lr: float,
        corpus: data.Corpus, final_windows: int = 1024, stop: int = 0,
        lr_warmup: int = 0) -> Dict[str, Any]:
    vs.BETAS = HF_BETAS
    vs.CLIP = HF_CLIP
    vs.WEIGHT_DECAY = 0.0
    opt = dict(vs.DEFAULTS)
    opt.update(FIXES[fix])
    if density >= 1.0:
        opt["dense"] = True
    cpu0 = time.process_time()
    m = hf_model(seed)
    params = list(m.parameters())
    n = sum(p.numel() for p in params)
    theta = torch.cat([p.detach().reshape(-1) for p in params])
    off = 0
    for p in params:
        p.data = theta[off:off + p.numel()].view_as(p)
        off += p.numel()
    sim = ProbeStep(theta, [p.numel() for p in params], [p.dim() <= 1 for p in params], WORLD,
                    density, warmup, opt, schedule=schedule)
    streams = [data.encode(data.rank_shard(corpus.train_docs, r, WORLD)) for r in range(WORLD)]
    batches = [data.Batches(streams[r], CONTEXT, BATCH, seed=seed * 1000 + r)
               for r in range(WORLD)]
    val = data.eval_windows(data.encode(corpus.val_docs), CONTEXT, final_windows)
    G = torch.zeros(WORLD, n)
    curve = []
    for step in range(stop or steps):
        if step % (steps // 10) == 0 and step:
            curve.append({"step": step, "val_loss": evaluate(m, val[:256])})
        for r in range(WORLD):
            x, y = batches[r].next()
            for p in params:
                p.grad = None
            loss_of(m, x, y).backward()
            G[r] = torch.cat([p.grad.reshape(-1) for p in params])
        sim.step(G, lr_cosine(step, steps, lr, lr_warmup))
    final = evaluate(m, val[:256] if stop else val)
    k = np.array(sim.mask_counts, dtype=np.float64)
    return {"schedule": schedule, "warmup": warmup, "fix": fix, "density": density,
            "seed": seed, "steps": steps, "stop": stop, "lr": lr, "lr_warmup": lr_warmup, "params": n, "final_val_loss": final,
            "curve": curve, "avg_mask_fraction": float(k.mean() / n), "probe": sim.rows,
            "cpu_seconds": time.process_time() - cpu0, "simulation": True,
            "torch": torch.__version__}


def summary(path: str) -> str:
    runs = vs.read_runs(path)
    groups: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for r in runs:
        g = (f"{r['density']:g} | {r['schedule']} | {r['warmup']} | {r['fix']}"
             f"{' + lr warm-up ' + str(r['lr_warmup']) if r.get('lr_warmup') else ''}")
        groups.setdefault(g, {})[r["seed"]] = r
    lines = ["| density | schedule | W | fix | seeds | final val loss per seed | median | "
             "avg density | max resid_driven in ramp | max |e| / |(1-b1)g| |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for g in sorted(groups):
        by = groups[g]
        vals = [by[s]["final_val_loss"] for s in sorted(by)]
        pr = [row for s in by for row in by[s]["probe"] if row["step"] > 0]
        rd = max((row["resid_driven"] for row in pr), default=0.0)
        ratio = max((row["e_norm"] / max(1e-12, row["g_norm"]) for row in pr), default=0.0)
        avg = np.mean([by[s]["avg_mask_fraction"] for s in by])
        lines.append(f"| {g} | {len(vals)} | {', '.join(f'{v:.4f}' for v in vals)} | "
                     f"{np.median(vals):.4f} | {avg:.4f} | {rd:.3f} | {ratio:.1f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", choices=("geometric", "linear"), default="geometric")
    ap.add_argument("--warmup", type=int, nargs="+", default=[0])
    ap.add_argument("--fix", choices=sorted(FIXES), nargs="+", default=["none"])
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--out", default=os.path.join(HERE, "out-sched"))
    ap.add_argument("--stop", type=int, default=0,
                    help="diagnostics only: stop after this many steps of the planned --steps "
                         "(the lr schedule stays the planned run's; loss on 256 windows)")
    ap.add_argument("--lr-warmup", type=int, default=0,
                    help="lr warm-up steps before the cosine (Trainer's warmup_steps)")
    ap.add_argument("--summary", action="store_true")
    a = ap.parse_args()
    path = os.path.join(a.out, "probe.jsonl" if not a.stop else f"probe-stop{a.stop}.jsonl")
    if a.summary:
        print(summary(path))
        return 0
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)
    corpus = data.load()
    done = {key(r) for r in vs.read_runs(path)}
    for w in a.warmup:
        for fix in a.fix:
            for s in a.seeds:
                spec = dict(schedule=a.schedule, warmup=w, fix=fix, density=a.density, seed=s,
                            steps=a.steps, lr=a.lr, lr_warmup=a.lr_warmup)
                if key(spec) in done:
                    print("have", key(spec), flush=True)
                    continue
                r = run(a.schedule, w, fix, a.density, s, a.steps, a.lr, corpus, stop=a.stop,
                        lr_warmup=a.lr_warmup)
                vs.append(path, r)
                print(f"{key(r)} final {r['final_val_loss']:.4f} cpu {r['cpu_seconds']:.0f}s",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
