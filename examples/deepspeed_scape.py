"""DeepSpeed with ScapeAdamS: the route of docs/frameworks.md, "DeepSpeed".

    python3 -m scape.launch -n 2 examples/deepspeed_scape.py
    python3 -m scape.launch -n 2 examples/deepspeed_scape.py --check-resume --dense-baseline
    deepspeed --num_gpus 8 examples/deepspeed_scape.py          # on a GPU node (NCCL)

A small MLP built in code learns a synthetic classification task (a fixed random teacher) on
every rank, each rank with its own batches. `scape.integrations.deepspeed.initialize` replaces
`deepspeed.initialize`: the engine's forward, backward (with gradient accumulation), step,
scheduler (a WarmupLR section) and checkpoints are DeepSpeed's; the gradient exchange is
ScapeAdamS's. The script checks, and exits non-zero otherwise:

- the loss falls and the parameters are bit-identical on every rank;
- DeepSpeed runs no gradient all-reduce: every torch.distributed.all_reduce issued between the
  first forward and the last engine.step() of a global batch is counted (0 with ScapeAdamS; the
  dense baseline shows DeepSpeed's own), and ScapeAdamS steps once per global batch although
  engine.step() runs once per micro-batch;
- with --check-resume: a second engine (another initialisation) resumed by
  engine.load_checkpoint from the half-way engine.save_checkpoint ends with the same bits and
  the same losses as the uninterrupted run, on every rank;
- with --check-bf16-resume: the same for a bfloat16 model (no bf16 section: ScapeAdamS's fp32
  masters step it), resumed from its own checkpoint;
- with --dense-baseline: at density 1.0 the losses equal, to fp32 rounding (--dense-rtol), those
  of DeepSpeed's own dense run (its gradient all-reduce, scape.integrations.reference.TorchAdamS
  as the client optimizer, the same config, data and schedule).
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
import tempfile

import torch
import torch.nn.functional as F

import deepspeed

import scape
from scape.integrations.deepspeed import initialize
from scape.integrations.reference import TorchAdamS

IN, HIDDEN, CLASSES = 32, 64, 8


def mlp(seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                            torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                            torch.nn.Linear(HIDDEN, CLASSES))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.05))
    return m


TEACHER = torch.randn(IN, CLASSES, generator=torch.Generator().manual_seed(99))


def batch(step: int, micro: int, rank: int, n: int):
    """This rank's micro-batch `micro` of global step `step` (the same in every run)."""
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * micro + rank)
    x = torch.randn(n, IN, generator=g)
    return x, (x @ TEACHER).argmax(dim=1)


class AllReduceCounter:
    """Counts torch.distributed all-reduces (DeepSpeed's comm layer ends in them) while
    `active`; ScapeAdamS does not use torch.distributed."""

    def __init__(self) -> None:
        self.active = False
        self.calls = 0
        self.elems = 0
        self._orig = {}
        for name in ("all_reduce", "all_reduce_coalesced"):
            f = getattr(torch.distributed, name, None)
            if f is None:
                continue
            self._orig[name] = f

            def wrapped(*a, _f=f, _name=name, **k):
                if self.active:
                    self.calls += 1
                    t = a[0] if a else k.get("tensor", k.get("tensors"))
                    ts = t if isinstance(t, (list, tuple)) else [t]
                    self.elems += sum(int(x.numel()) for x in ts if torch.is_tensor(x))
                return _f(*a, **k)

            setattr(torch.distributed, name, wrapped)


def config(a) -> dict:
    return {
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": a.gas,
        "steps_per_print": 1 << 30,
        "zero_optimization": {"stage": 0},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": a.lr,
                                 "warmup_num_steps": 4, "warmup_type": "linear"}},
    }


def make_engine(a, comm, kind: str, density: float, seed: int = 0, max_grad_norm=None):
    model = mlp(seed)
    if a.bf16:  # 16-bit parameters: ScapeAdamS keeps their fp32 masters (no bf16 section)
        model = model.to(torch.bfloat16)
    hyper = dict(lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    if kind == "torch-adams":  # DeepSpeed's own data parallelism, the same AdamS update
        engine, opt, _, _ = deepspeed.initialize(
            model=model, optimizer=TorchAdamS(model.parameters(), **hyper), config=config(a))
    else:
        engine, opt, _, _ = initialize(
            model=model, config=config(a), comm=comm, density=density,
            warmup_steps=0 if density == 1.0 else 4,
            max_grad_norm=a.max_grad_norm if max_grad_norm is None else max_grad_norm, **hyper)
    steps = [0]
    inner = opt.step

    def counted_step(*x, **k):
        steps[0] += 1
        return inner(*x, **k)

    opt.step = counted_step  # the check: how often the client optimizer really steps
    return engine, opt, steps


def train(engine, counter, a, rank, until: int, save_at: int = -1, ckpt: str = "",
          norms=None):
    """Trains from engine.global_steps to `until`; returns this rank's mean loss per global
    step and the torch.distributed all-reduces counted in each. `norms`, if a list, gets the
    L2 norm of the gradient the optimizer stepped with in each global batch (the averaged,
    accumulated one: DeepSpeed's after its all-reduce, ScapeAdamS's recovered one)."""
    losses, per_step = [], []
    while engine.global_steps < until:
        s = engine.global_steps
        counter.active, before, tot = True, counter.calls, 0.0
        for m in range(a.gas):
            x, y = batch(s, m, rank, a.batch)
            x, y = x.to(engine.device, torch.bfloat16 if a.bf16 else torch.float32), \
                y.to(engine.device)
            loss = F.cross_entropy(engine(x).float(), y)
            engine.backward(loss)
            if norms is not None and m == a.gas - 1 and not hasattr(engine, "scape_optimizer"):
                norms.append(float(torch.sqrt(sum(p.grad.double().square().sum()
                                                  for p in engine.module.parameters()))))
            engine.step()
            tot += float(loss)
        counter.active = False
        if norms is not None and hasattr(engine, "scape_optimizer"):
            norms.append(float(engine.scape_optimizer.grad_norm))
        per_step.append(counter.calls - before)
        losses.append(tot / a.gas)
        if engine.global_steps == save_at:
            engine.save_checkpoint(ckpt, tag=f"step{save_at}")
    return losses, per_step


def param_hash(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()


def same_on_every_rank(text: str) -> bool:
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, text)
    return all(t == text for t in every)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--density", type=float, default=0.1, help="ScapeAdamS density")
    ap.add_argument("--steps", type=int, default=16, help="global batches (optimizer steps)")
    ap.add_argument("--gas", type=int, default=2, help="gradient_accumulation_steps")
    ap.add_argument("--batch", type=int, default=16, help="micro-batch per rank")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="ScapeAdamS's clipping of the averaged gradient (not DeepSpeed's)")
    ap.add_argument("--check-resume", action="store_true",
                    help="resume a new engine from the half-way checkpoint, compare the bits")
    ap.add_argument("--dense-baseline", action="store_true",
                    help="also run DeepSpeed's own dense data parallelism with TorchAdamS and "
                         "ScapeAdamS at density 1.0, compare the losses")
    ap.add_argument("--dense-steps", type=int, default=8)
    ap.add_argument("--dense-rtol", type=float, default=1e-5,
                    help="largest relative loss (and gradient-norm) difference allowed in "
                         "--dense-baseline: fp32 rounding (see docs/frameworks.md)")
    ap.add_argument("--bf16", action="store_true",
                    help="train bfloat16 parameters (ScapeAdamS's fp32 masters step them)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=-1,
                    help="passed by the deepspeed launcher (LOCAL_RANK is read from the "
                         "environment)")
    ap.add_argument("--check-bf16-resume", action="store_true",
                    help="also train bfloat16 parameters (--bf16-steps) and resume them")
    ap.add_argument("--bf16-steps", type=int, default=6)
    ap.add_argument("--verbose", action="store_true", help="keep DeepSpeed's INFO logging")
    a = ap.parse_args()
    if not a.verbose:
        deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed()  # the accelerator's backend: gloo on CPU, NCCL on GPUs
    timeout = int(os.environ.get("SCAPE_TIMEOUT_MS", "120000"))
    # the SCAPE communicator of the same ranks: NCCL for CUDA parameters, UCX on CPU
    backend = "nccl" if deepspeed.get_accelerator().device_name() == "cuda" else "ucx"
    comm = scape.Communicator.from_process_group(backend=backend, timeout_ms=timeout)
    rank = comm.rank
    counter = AllReduceCounter()
    tmp = [tempfile.mkdtemp(prefix="scape_ds_") if rank == 0 else None]
    torch.distributed.broadcast_object_list(tmp, src=0)
    ckpt = os.path.join(tmp[0], "ckpt")
    ok = True
    try:
        half = a.steps // 2
        engine, opt, nsteps = make_engine(a, comm, "scape", a.density)
        losses, per_step = train(engine, counter, a, rank, a.steps,
                                 save_at=half if a.check_resume else -1, ckpt=ckpt)
        h = param_hash(engine.module)
        same = same_on_every_rank(h)
        falls = sum(losses[-3:]) < sum(losses[:3])
        nparams = sum(p.numel() for p in engine.module.parameters())
        if rank == 0:
            print(f"deepspeed {deepspeed.__version__} engine {type(engine).__name__} optimizer "
                  f"{type(engine.optimizer).__name__} density {a.density} steps {a.steps} "
                  f"gradient_accumulation_steps {a.gas} params {nparams} "
                  f"{next(engine.module.parameters()).dtype}")
            print(f"loss first {losses[0]:.4f} last {losses[-1]:.4f} falls: {falls}")
            print(f"optimizer steps {nsteps[0]} for {a.steps} global batches of {a.gas} "
                  f"micro-batches (engine.step() calls: {a.steps * a.gas})")
            print(f"gradient all-reduces by DeepSpeed per global batch: max {max(per_step)} "
                  f"(allreduce_gradients calls skipped: {engine.scape_skipped_allreduces})")
            print(f"bytes sent by ScapeAdamS in the last step (rank 0): {opt.bytes_sent()}")
            print(f"ranks identical: {same}")
        ok = same and falls and max(per_step) == 0 and nsteps[0] == a.steps

        if a.check_resume:
            engine2, opt2, _ = make_engine(a, comm, "scape", a.density, seed=7)
            path, _ = engine2.load_checkpoint(ckpt)  # "latest": step{half}
            at = engine2.global_steps
            losses2, _ = train(engine2, counter, a, rank, a.steps)
            h2 = param_hash(engine2.module)
            identical = h2 == h and losses2 == losses[half:]
            every = [None] * comm.size
            torch.distributed.all_gather_object(every, identical)
            print(f"rank {rank}: resume from {os.path.basename(os.path.dirname(path))} "
                  f"(global step {at}) bit-identical to the uninterrupted run: {identical}")
            if rank == 0:
                print(f"resume bit-identical on every rank: {all(every)}")
            ok = ok and all(every) and at == half
            opt2.destroy()
        opt.destroy()

        if a.check_bf16_resume and not a.bf16:
            # bfloat16 parameters, no DeepSpeed bf16 section: ScapeAdamS's fp32 masters step
            # them and travel in each rank's checkpoint file
            b = argparse.Namespace(**dict(vars(a), bf16=True))
            n, bdir = a.bf16_steps, os.path.join(tmp[0], "ckpt_bf16")
            e1, o1, _ = make_engine(b, comm, "scape", a.density)
            l1, ar1 = train(e1, counter, b, rank, n, save_at=n // 2, ckpt=bdir)
            masters = o1.master_weights()[0] is not None
            e2, o2, _ = make_engine(b, comm, "scape", a.density, seed=7)
            e2.load_checkpoint(bdir)
            l2, _ = train(e2, counter, b, rank, n)
            same_b = param_hash(e1.module) == param_hash(e2.module) and l2 == l1[n // 2:]
            every = [None] * comm.size
            torch.distributed.all_gather_object(every, same_b and masters and max(ar1) == 0)
            if rank == 0:
                print(f"bf16 parameters ({next(e1.module.parameters()).dtype}, fp32 masters: "
                      f"{masters}): resume bit-identical on every rank: {all(every)}")
            ok = ok and all(every)
            o1.destroy()
            o2.destroy()

        if a.dense_baseline:
            ref, _, _ = make_engine(a, comm, "torch-adams", 1.0)
            ref_norms, sc_norms = [], []
            ref_losses, ref_ar = train(ref, counter, a, rank, a.dense_steps, norms=ref_norms)
            sc, sc_opt, _ = make_engine(a, comm, "scape", 1.0, max_grad_norm=0.0)
            sc_losses, sc_ar = train(sc, counter, a, rank, a.dense_steps, norms=sc_norms)
            rel = max(abs(x - y) / abs(y) for x, y in zip(sc_losses, ref_losses))
            nrel = max(abs(x - y) / abs(y) for x, y in zip(sc_norms, ref_norms))
            every = [None] * comm.size
            torch.distributed.all_gather_object(every, (rel, nrel))
            rel, nrel = max(e[0] for e in every), max(e[1] for e in every)
            if rank == 0:
                print(f"dense baseline (DeepSpeed's all-reduce + TorchAdamS): gradient "
                      f"all-reduces per global batch {max(ref_ar)}; ScapeAdamS density 1.0: "
                      f"{max(sc_ar)}")
                print("dense losses deepspeed+TorchAdamS: " +
                      " ".join(f"{x:.6f}" for x in ref_losses))
                print("dense losses ScapeAdamS d=1.0:     " +
                      " ".join(f"{x:.6f}" for x in sc_losses))
                print(f"dense baseline max relative loss difference: {rel:.3e} "
                      f"(tolerance {a.dense_rtol:g}): {rel <= a.dense_rtol}")
                # the gradient each optimizer stepped with: the mean over micro-batches and
                # ranks in both (a sum over micro-batches would be gas times larger)
                print(f"dense baseline max relative gradient-norm difference: {nrel:.3e} "
                      f"(tolerance {a.dense_rtol:g}): {nrel <= a.dense_rtol}")
            ok = (ok and rel <= a.dense_rtol and nrel <= a.dense_rtol and max(ref_ar) > 0
                  and max(sc_ar) == 0)
            sc_opt.destroy()
    finally:
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(tmp[0], ignore_errors=True)
    comm.destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
