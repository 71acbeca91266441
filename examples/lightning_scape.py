"""PyTorch Lightning with ScapeAdamS: ``Trainer(strategy=ScapeStrategy())`` on 2 ranks.

    python3 -m scape.launch -n 2 examples/lightning_scape.py
    python3 -m scape.launch -n 2 examples/lightning_scape.py --check-resume --dense-baseline

On torch < 2.1 with Python 3.11 (Debian 12's torch 1.13) Lightning needs the CPU-only patch
the test harness applies (tests/python/test_fw_lightning.py)::

    python3 -m scape.launch -n 2 tests/python/frameworks/run_patched.py \
        cpu_patches_lightning examples/lightning_scape.py --check-resume --dense-baseline

A small MLP built in code learns a synthetic teacher (nothing is downloaded). The
LightningModule's ``configure_optimizers`` returns ScapeAdamS from
``trainer.strategy.scape_optimizer(...)``; the Trainer accumulates 2 micro-batches per step,
clips by norm (``gradient_clip_val``, which becomes ScapeAdamS's ``max_grad_norm``), steps an
LR scheduler and saves a checkpoint every epoch (ModelCheckpoint). Works with
``pytorch_lightning`` or ``lightning.pytorch`` (``--flavour``). Checks, exiting non-zero
otherwise:

- the loss falls; the parameters are bit-identical on every rank; ScapeAdamS stepped once per
  global batch (Lightning's global_step);
- no gloo all-reduce at all runs in a training batch (torch's profiler records every gloo
  all-reduce between on_train_batch_start and on_train_batch_end: forward, backward and,
  on the last micro-batch, the optimizer step): 0 with ScapeStrategy, micro-batches included;
  the dense baseline's DDP shows its gradient buckets (the counter sees them);
- --check-resume: ``trainer.fit(model, ckpt_path=...)`` from the half-way checkpoint (rank 0's
  file, holding every rank's ScapeAdamS state) ends with the same parameter bits and the same
  per-batch losses as the uninterrupted run, on every rank;
- --dense-baseline: ScapeAdamS at density 1.0 against Lightning's own DDPStrategy (gradient
  all-reduce) with scape.integrations.reference.TorchAdamS, the same AdamS update: every
  per-batch loss agrees to --dense-rtol (fp32 rounding: ScapeAdamS averages b1*m + (1-b1)*g
  over ranks, DDP averages g, so the last bits differ and the difference grows slowly);
- --check-refusals: ``gradient_clip_algorithm="value"`` and an optimizer that is not ScapeAdamS
  are refused at setup with a message on every rank.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

from scape.integrations import ensure_process_group
from scape.integrations.lightning import strategy_class
from scape.optim import ScapeAdamS
from scape.integrations.reference import TorchAdamS

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*Checkpoint directory.*exists and is not empty.*")
warnings.filterwarnings("ignore", ".*callbacks used to create the checkpoint need to be provided.*")

IN, HIDDEN, OUT = 16, 64, 4


class Teacher(torch.utils.data.Dataset):
    """Inputs x ~ N(0, 1) and the class a fixed random two-layer teacher gives them."""

    def __init__(self, n: int, seed: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, IN, generator=g)
        w1 = torch.randn(IN, 32, generator=g)
        w2 = torch.randn(32, OUT, generator=g)
        self.y = torch.tanh(self.x @ w1).matmul(w2).argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def make_module(pl, a, mode: str, seed: int):
    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.net = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(),
                                           torch.nn.LayerNorm(HIDDEN),
                                           torch.nn.Linear(HIDDEN, OUT))
            self.losses = []  # every micro-batch's loss on this rank, in order

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            kw = dict(lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
            if mode == "dense":
                opt = TorchAdamS(self.parameters(), **kw)
            elif mode == "sgd":
                opt = torch.optim.SGD(self.parameters(), lr=a.lr)
            else:
                density = 1.0 if mode == "scape-dense" else a.density
                opt = self.trainer.strategy.scape_optimizer(self.parameters(), density=density,
                                                            **kw)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.02 * s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Net()


def make_probe(pl):
    class AllReduceProbe(pl.Callback):
        """Per training batch, the element counts of the gloo all-reduces torch's profiler
        saw, and ScapeAdamS's bytes after each optimizer step."""

        def __init__(self) -> None:
            self.prof = None
            self.allreduces = []
            self.bytes = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.prof = torch.autograd.profiler.profile(record_shapes=True)
            self.prof.__enter__()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.prof.__exit__(None, None, None)
            self.allreduces.append([int(torch.Size(e.input_shapes[0]).numel())
                                    if e.input_shapes else -1
                                    for e in self.prof.function_events
                                    if e.name == "gloo:all_reduce"])
            self.prof = None
            opt = trainer.optimizers[0]
            if isinstance(opt, ScapeAdamS):
                self.bytes.append(opt.bytes_sent())

    return AllReduceProbe()


def param_hash(module) -> str:
    h = hashlib.sha256()
    for _, p in sorted(module.state_dict().items()):
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def same_on_every_rank(text: str) -> bool:
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, text)
    return all(g == got[0] for g in got)


def run(pl, a, mode: str, out: str, *, seed: int = 0, ckpt_path=None, checkpoints=False,
        made=None, **trainer_kw):
    """One Trainer.fit; returns (module, trainer, probe)."""
    if mode in ("scape", "scape-dense", "sgd"):
        strategy = strategy_class(a.flavour)(process_group_backend="gloo")
    else:
        strategy = pl.strategies.DDPStrategy(process_group_backend="gloo")
    probe = make_probe(pl)
    callbacks = [probe]
    if checkpoints:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=out, filename="{epoch}",
                                                      save_top_k=-1, every_n_epochs=1))
    kw = dict(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy,
              max_epochs=a.epochs, accumulate_grad_batches=a.accumulate,
              gradient_clip_val=a.clip, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=checkpoints,
              callbacks=callbacks, default_root_dir=out, num_sanity_val_steps=0)
    kw.update(trainer_kw)
    trainer = pl.Trainer(**kw)
    if made is not None:
        made.append(trainer)
    module = make_module(pl, a, mode, seed)
    loader = torch.utils.data.DataLoader(Teacher(a.samples), batch_size=a.batch, shuffle=True)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module, trainer, probe


def close(trainer) -> None:
    close = getattr(trainer.strategy, "close", None)
    if close is not None:
        close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavour", choices=("pytorch_lightning", "lightning.pytorch"),
                    default=None, help="which Lightning package (default: pytorch_lightning "
                                       "if installed)")
    ap.add_argument("--density", type=float, default=0.1, help="ScapeAdamS density")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--samples", type=int, default=256, help="all ranks together")
    ap.add_argument("--batch", type=int, default=8, help="micro-batch, per rank")
    ap.add_argument("--accumulate", type=int, default=2, help="accumulate_grad_batches")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (by norm)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--check-resume", action="store_true")
    ap.add_argument("--dense-baseline", action="store_true")
    ap.add_argument("--dense-rtol", type=float, default=1e-5)
    ap.add_argument("--check-refusals", action="store_true")
    ap.add_argument("--out", default="", help="output folder (default: a temporary one)")
    a = ap.parse_args()
    flavour = a.flavour or ("pytorch_lightning" if importlib.util.find_spec("pytorch_lightning")
                            else "lightning.pytorch")
    a.flavour = flavour
    pl = importlib.import_module(flavour)
    ensure_process_group()  # Lightning takes the existing group (gloo)
    rank = dist.get_rank()
    tmp = None
    out = [a.out or (tempfile.mkdtemp(prefix="scape_pl_") if rank == 0 else None)]
    tmp = out[0] if not a.out and rank == 0 else None
    dist.broadcast_object_list(out, 0)
    out = out[0]
    ok = True
    try:
        m, t, probe = run(pl, a, "scape", os.path.join(out, "a"), checkpoints=True)
        h = param_hash(m)
        same = same_on_every_rank(h)
        opt = t.strategy.optimizers[0]
        steps = opt.info()[0]["step"]
        batches = len(probe.allreduces)
        nparams = sum(p.numel() for p in m.parameters())
        n_ar = sum(len(s) for s in probe.allreduces)
        first = sum(m.losses[:8]) / 8
        last = sum(m.losses[-8:]) / 8
        if rank == 0:
            print(f"{flavour} {pl.__version__}, torch {torch.__version__}: ScapeStrategy, "
                  f"ScapeAdamS density {a.density}, {nparams} parameters, "
                  f"accumulate_grad_batches {a.accumulate}, gradient_clip_val {a.clip}")
            print(f"loss first {first:.4f} last {last:.4f} (mean of 8 micro-batches, rank 0)")
            print(f"micro-batches {batches}, optimizer steps {steps}, global_step "
                  f"{t.global_step}")
            print(f"ScapeAdamS max_grad_norm {opt.param_groups[0]['max_grad_norm']}, "
                  f"trainer.gradient_clip_val after fit {t.gradient_clip_val}")
            print(f"bytes sent per step (ScapeAdamS, rank 0, last): {probe.bytes[-1]} of "
                  f"{4 * nparams} dense")
            print(f"gloo all-reduces in training batches: {n_ar}")
            print(f"ranks identical: {same}")
        ok = (same and last < first and n_ar == 0 and steps == t.global_step
              and steps * a.accumulate == batches)
        if a.check_resume:
            half = a.epochs // 2
            ckpt = os.path.join(out, "a", f"epoch={half - 1}.ckpt")
            tail = m.losses[len(m.losses) * half // a.epochs:]
            m2, t2, _ = run(pl, a, "scape", os.path.join(out, "b"), seed=7, ckpt_path=ckpt)
            identical = param_hash(m2) == h and m2.losses == tail
            agreed = torch.tensor([1.0 if identical else 0.0])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            print(f"rank {rank}: resume from {os.path.basename(ckpt)} bit-identical to the "
                  f"uninterrupted run: {identical} ({len(m2.losses)} micro-batch losses "
                  f"equal: {m2.losses == tail})")
            if rank == 0:
                print(f"resume bit-identical on every rank: {bool(agreed[0] == 1.0)}")
            ok = ok and bool(agreed[0] == 1.0)
            close(t2)
        close(t)
        if a.dense_baseline:
            ms, ts, ps = run(pl, a, "scape-dense", os.path.join(out, "c"))
            close(ts)  # its communicator and optimizer freed on every rank before DDP's run
            md, td, pd = run(pl, a, "dense", os.path.join(out, "d"))
            ls, ld = torch.tensor(ms.losses), torch.tensor(md.losses)
            rel = float(((ls - ld).abs() / ld.abs()).max()) if len(ls) == len(ld) else 1e9
            worst = torch.tensor([rel])
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            ddp_ar = max(len(s) for s in pd.allreduces)
            ddp_elems = max(sum(s) for s in pd.allreduces)
            if rank == 0:
                print(f"dense baseline (DDPStrategy + TorchAdamS): gloo all-reduces in a "
                      f"training batch up to {ddp_ar} ({ddp_elems} elements; parameters "
                      f"{nparams})")
                print(f"density 1.0 vs dense baseline: {len(ls)} losses, max relative "
                      f"difference {float(worst[0]):.2e} (tolerance {a.dense_rtol:g}), first "
                      f"{ls[0]:.6f} / {ld[0]:.6f}, last {ls[-1]:.6f} / {ld[-1]:.6f}")
            ok = ok and float(worst[0]) <= a.dense_rtol and ddp_ar > 0
        if a.check_refusals:
            for what, mode, kw in (("gradient_clip_algorithm='value'", "scape",
                                    {"gradient_clip_algorithm": "value"}),
                                   ("torch.optim.SGD", "sgd", {})):
                made = []
                try:
                    run(pl, a, mode, os.path.join(out, "e"), made=made, **kw)
                    msg = "not refused"
                    ok = False
                except (ValueError, TypeError) as e:
                    msg = f"refused: {type(e).__name__}: {e}"
                for tr in made:
                    close(tr)
                if rank == 0:
                    print(f"{what}: {msg[:200]}")
    finally:
        dist.barrier()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
