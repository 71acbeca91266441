"""A worked example of docs/frameworks.md: a Megatron-LM / DeepSpeed-style data-parallel
training loop whose optimizer is swapped for scape.optim.ScapeAdamS.

What changes against the usual loop (each marked "SCAPE:" below):
  - no DistributedDataParallel wrapper and no gradient all-reduce: ScapeAdamS.step() does the
    data-parallel exchange itself (values only, at the agreed mask);
  - no clip_grad_norm_ on the local gradients: clipping is `max_grad_norm`, applied by the
    library to the recovered (averaged) gradient;
  - the optimizer is built from the framework's own param groups (weight decay for matrices,
    none for norms and biases), and its LR scheduler drives `group["lr"]` as usual;
  - checkpoints: each rank saves and loads its own optimizer state_dict (the library's
    checkpoint inside), beside the model's.

Run it on 2 local ranks (or under torchrun / mpirun, which set the same variables):

    python3 -m scape.launch -n 2 examples/megatron_style_scape.py
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import tempfile

import numpy as np
import torch
import torch.nn as nn

import scape
from scape.optim import ScapeAdamS


class TinyLM(nn.Module):
    """Stand-in for the framework's model: embeddings, two MLP blocks with LayerNorm, head."""

    def __init__(self, vocab: int = 64, d: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            for _ in range(2))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h))


def get_param_groups(model: nn.Module, weight_decay: float):
    """What Megatron's get_param_groups / DeepSpeed's client code do: no decay for biases and
    norms. ScapeAdamS keeps the 1-D tensors dense by default as well."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() <= 1 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, comm: scape.Communicator, args):
    # Before (Megatron): optimizer = Adam(param_groups, lr=..., betas=..., eps=...) wrapped in
    # a DistributedOptimizer / FP32Optimizer that all-reduces or reduce-scatters gradients.
    # SCAPE: the optimizer owns the exchange.
    return ScapeAdamS(get_param_groups(model, args.weight_decay), comm, lr=args.lr,
                      betas=(0.9, 0.95), eps=1e-8, density=args.density,
                      warmup_steps=args.density_warmup, max_grad_norm=args.clip_grad,
                      sharded=args.sharded, payload_dtype=torch.bfloat16)


def lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))
    return f


def batch(step: int, rank: int, vocab: int = 64):
    """This rank's data shard: a learnable toy language (next token = (3 * token + 1) % V)."""
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randint(0, vocab, (16, 32), generator=g)
    return x, (3 * x + 1) % vocab


def model_hash(model: nn.Module) -> np.ndarray:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return np.frombuffer(h.digest(), dtype=np.int64).copy()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--density-warmup", type=int, default=20)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--sharded", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)

    # SCAPE: no torch.distributed.init_process_group needed; the communicator reads the same
    # launcher variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT + 1).
    with scape.Communicator.from_env() as comm:
        torch.manual_seed(1234)
        model = TinyLM()  # SCAPE: no DistributedDataParallel(model)
        optimizer = build_optimizer(model, comm, args)  # broadcasts rank 0's parameters
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                      lr_lambda(args.steps // 10, args.steps))
        loss_fn = nn.CrossEntropyLoss()
        ckpt_dir = tempfile.mkdtemp(prefix="scape_example_")
        ckpt = os.path.join(ckpt_dir, f"rank{comm.rank}.pt")
        first = last = None
        for step in range(args.steps):
            x, y = batch(step, comm.rank)
            optimizer.zero_grad()
            loss = loss_fn(model(x).reshape(-1, 64), y.reshape(-1))
            loss.backward()
            # SCAPE: no all_reduce of p.grad, no clip_grad_norm_(model.parameters(), ...)
            optimizer.step()
            scheduler.step()
            first = float(loss) if first is None else first
            last = float(loss)
            if step == args.steps // 2:
                # Checkpoint as frameworks do (one file per data-parallel rank), then resume.
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "step": step}, ckpt)
                state = torch.load(ckpt)
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])  # collective: every rank
                scheduler.load_state_dict(state["scheduler"])
        info = optimizer.info()
        hashes = comm.all_gather(model_hash(model)).reshape(comm.size, -1)
        identical = bool((hashes == hashes[0]).all())
        optimizer.destroy()
        os.remove(ckpt)
        os.rmdir(ckpt_dir)
        if comm.rank == 0:
            sent = sum(i["bytes_sent"] for i in info)
            print(f"loss {first:.3f} -> {last:.3f}; ranks identical: {identical}; "
                  f"bytes sent in the last step {sent} (dense fp32 all-reduce: "
                  f"{int(2 * (comm.size - 1) / comm.size * 4 * sum(p.numel() for p in model.parameters()))})")
        ok = identical and last < first
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
