"""sched_probe.py's setting through the library (ScapeAdamS on real ranks), to check what the
simulation says about the density schedule: the same model, data shards, batches, cosine lr,
Hugging Face Trainer's optimizer defaults (betas (0.9, 0.999), eps 1e-8, no weight decay,
max_grad_norm 1 clipping the recovered gradient) and final evaluation. Rank 0 appends one JSON
line to OUT/lib.jsonl.

    nice -n 10 /usr/bin/python3 -m scape.launch -n 2 perf/train/sched_lib.py \\
        --schedule geometric --warmup 100 --seed 1
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import data  # noqa: E402
import sched_probe as sp  # noqa: E402
import variant_sim as vs  # noqa: E402

import scape  # noqa: E402
from scape.optim import ScapeAdamS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", choices=("geometric", "linear"), default="geometric")
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=sp.STEPS)
    ap.add_argument("--lr", type=float, default=sp.LR)
    ap.add_argument("--out", default=os.path.join(HERE, "out-sched"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    path = os.path.join(a.out, "lib.jsonl")
    for r in vs.read_runs(path):  # resumable: a finished run is not run again
        if (r["schedule"], r["warmup"], r["density"], r["seed"], r["steps"], r["lr"]) == \
                (a.schedule, a.warmup, a.density, a.seed, a.steps, a.lr):
            print(f"have {path}: {r['final_val_loss']:.4f}", flush=True)
            return 0
    comm = scape.Communicator.from_env()
    rank, world = comm.rank, comm.size
    corpus = data.load()
    m = sp.hf_model(a.seed)
    opt = ScapeAdamS(m.parameters(), comm, lr=a.lr, betas=sp.HF_BETAS, eps=1e-8,
                     weight_decay=0.0, density=a.density, warmup_steps=a.warmup,
                     density_schedule=a.schedule, max_grad_norm=sp.HF_CLIP)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: sp.lr_cosine(s, a.steps, 1.0))
    stream = data.encode(data.rank_shard(corpus.train_docs, rank, world))
    batches = data.Batches(stream, sp.CONTEXT, sp.BATCH, seed=a.seed * 1000 + rank)
    val = data.eval_windows(data.encode(corpus.val_docs), sp.CONTEXT, 1024)
    cpu0 = time.process_time()
    for step in range(a.steps):
        x, y = batches.next()
        opt.zero_grad()
        sp.loss_of(m, x, y).backward()
        opt.step()
        sched.step()
    final = sp.evaluate(m, val)
    same = opt.parameter_hash()
    if rank == 0:
        r = {"schedule": a.schedule, "warmup": a.warmup, "density": a.density, "seed": a.seed,
             "steps": a.steps, "lr": a.lr, "world": world, "final_val_loss": final,
             "cpu_seconds_rank0": time.process_time() - cpu0, "library": True,
             "param_hash": same}
        os.makedirs(a.out, exist_ok=True)
        vs.append(path, r)
        print(json.dumps({k: v for k, v in r.items() if k != "param_hash"}), flush=True)
    opt.destroy()
    comm.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
