"""Hugging Face Trainer with ScapeAdamS: the route of docs/frameworks.md section 7.1.

    HF_HUB_OFFLINE=1 python3 -m scape.launch -n 2 examples/hf_trainer_scape.py
    HF_HUB_OFFLINE=1 python3 -m scape.launch -n 2 examples/hf_trainer_scape.py --check-resume
    HF_HUB_OFFLINE=1 python3 -m scape.launch -n 2 examples/hf_trainer_scape.py --optim adamw

A tiny GPT-2 built in code (examples/tiny_gpt2.py) learns a synthetic motif language on 2
ranks. `scape.integrations.hf.ScapeTrainer` replaces `transformers.Trainer`; everything else
is Trainer's (its scheduler, its data sharding, its checkpoints). The script checks, and exits
non-zero otherwise:

- the loss falls, and the parameters are bit-identical on every rank;
- no dense gradient all-reduce runs in a training step (torch's profiler counts the gloo
  all-reduces between Trainer's on_step_begin and on_step_end: 0 with ScapeAdamS; the
  `--optim adamw` baseline, plain Trainer + DDP + torch AdamW, shows DDP's);
- with --check-resume: a run interrupted at half the steps and resumed with
  `train(resume_from_checkpoint=...)` from Trainer's checkpoint (rank 0's optimizer.pt, which
  holds every rank's state) ends with the same bits as the uninterrupted run, on every rank.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt2 import MotifDataset, all_equal_over, param_hash, tiny_gpt2  # noqa: E402

import scape  # noqa: E402
from scape.integrations import ensure_process_group, skip_bool_buffers_in_ddp  # noqa: E402
from scape.integrations.hf import (ScapeTrainer, compat_training_args,  # noqa: E402
                                   scape_optimizer)


class StepProbe(TrainerCallback):
    """Records, per training step (Trainer's on_step_begin to on_step_end: forward, backward
    and the optimizer step), the sizes of the gloo all-reduces torch's profiler saw, and the
    bytes ScapeAdamS sent."""

    def __init__(self, trainer_ref) -> None:
        self.trainer_ref = trainer_ref
        self.prof = None
        self.allreduces = []
        self.bytes = []
        self.losses = []

    def on_step_begin(self, args, state, control, **kw):
        self.prof = torch.autograd.profiler.profile(record_shapes=True)
        self.prof.__enter__()

    def on_step_end(self, args, state, control, **kw):
        self.prof.__exit__(None, None, None)
        # DDP with find_unused_parameters=True (Trainer's default for a PreTrainedModel)
        # all-reduces its used-parameter map, one int per parameter tensor: not a gradient.
        self.allreduces.append([int(torch.Size(e.input_shapes[0]).numel())
                                if e.input_shapes else -1
                                for e in self.prof.function_events
                                if e.name == "gloo:all_reduce"])
        self.prof = None
        t = self.trainer_ref()
        if t is not None and isinstance(t, ScapeTrainer):
            self.bytes.append(scape_optimizer(t.optimizer).bytes_sent())

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def make_trainer(a, out, steps, comm, seed_model=0):
    import weakref

    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=a.batch,
        learning_rate=a.lr, weight_decay=0.01, warmup_steps=0, lr_scheduler_type="cosine",
        adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, logging_steps=a.log_every,
        save_steps=a.save_every or steps, save_strategy="steps", seed=1, data_seed=1,
        report_to=[], disable_tqdm=True, use_cpu=True, ddp_backend="gloo",
        dataloader_num_workers=0, save_safetensors=True, log_level="error")
    model = tiny_gpt2(seed=seed_model)
    ds = MotifDataset(a.samples)
    if a.optim == "adamw":
        # plain Trainer + DDP: gloo on torch 1.x cannot broadcast GPT-2's bool mask buffers
        t = transformers.Trainer(model=skip_bool_buffers_in_ddp(model),
                                 args=compat_training_args(args), train_dataset=ds)
    else:
        t = ScapeTrainer(model=model, args=args, train_dataset=ds, comm=comm,
                         scape_kwargs={"density": a.density,
                                       "warmup_fraction": a.warmup_fraction})
    probe = StepProbe(weakref.ref(t))
    t.add_callback(probe)
    return t, probe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optim", choices=("scape", "adamw"), default="scape",
                    help="scape: ScapeTrainer (default); adamw: plain Trainer, DDP, AdamW")
    ap.add_argument("--density", type=float, default=0.1, help="ScapeAdamS density")
    ap.add_argument("--warmup-fraction", type=float, default=0.25,
                    help="ScapeAdamS density warm-up, a fraction of --steps (ScapeTrainer passes "
                         "max_steps as total_steps)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16, help="per rank")
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--check-resume", action="store_true",
                    help="also resume from the half-way checkpoint and compare the bits")
    ap.add_argument("--out", default="", help="output folder (default: a temporary one)")
    a = ap.parse_args()
    ensure_process_group()
    comm = scape.Communicator.from_env(timeout_ms=int(os.environ.get("SCAPE_TIMEOUT_MS",
                                                                     "120000")))
    rank = comm.rank
    tmp = None
    out = a.out
    if not out:
        # one folder for all ranks: rank 0 makes it and tells the others over the communicator
        name = torch.zeros(64, dtype=torch.int32)
        if rank == 0:
            tmp = tempfile.mkdtemp(prefix="scape_hf_")
            name[:len(tmp)] = torch.tensor([ord(c) for c in tmp], dtype=torch.int32)
        comm.broadcast(name, root=0)
        out = "".join(chr(int(c)) for c in name if int(c))
    ok = True
    try:
        half = a.steps // 2
        if a.check_resume:
            a.save_every = half
        t, probe = make_trainer(a, os.path.join(out, "a"), a.steps, comm)
        t.train()
        h = param_hash(t.model)
        same = all_equal_over(comm, h)
        first, last = probe.losses[0], probe.losses[-1]
        nparams = sum(p.numel() for p in t.model.parameters())
        ntensors = len(list(t.model.parameters()))
        dense_ar = max(sum(1 for k in step if k < 0 or k > ntensors) for step in probe.allreduces)
        all_ar = max(len(step) for step in probe.allreduces)
        grad_elems = max(sum(k for k in step if k > ntensors) for step in probe.allreduces)
        if rank == 0:
            print(f"optim {a.optim} density {a.density if a.optim == 'scape' else 1.0} "
                  f"steps {a.steps} params {nparams}")
            print(f"loss first {first:.4f} last {last:.4f}")
            if not probe.bytes:
                print(f"bytes all-reduced per step (DDP's gradient buckets, fp32): "
                      f"{4 * grad_elems}")
            if probe.bytes:
                print(f"bytes sent per step (ScapeAdamS, rank 0, mean of the last half): "
                      f"{sum(probe.bytes[half:]) / max(1, len(probe.bytes[half:])):.0f}")
            print(f"gloo all-reduces in a training step: {all_ar} (sizes "
                  f"{sorted(set(k for st in probe.allreduces for k in st))}; {ntensors} "
                  f"parameter tensors)")
            print(f"dense gradient all-reduces in a training step: {dense_ar} "
                  f"({grad_elems} gradient elements all-reduced of {nparams})")
            print(f"ranks identical: {same}")
        ok = same and last < first
        if a.optim == "scape":
            # no gradient, and nothing else either: ScapeTrainer turns DDP's used-parameter
            # map off (find_unused_parameters), so a step sends no gloo all-reduce at all
            ok = ok and dense_ar == 0 and all_ar == 0
        if a.check_resume:
            if isinstance(t, ScapeTrainer):
                scape_optimizer(t.optimizer).destroy()
            ckpt = os.path.join(out, "a", f"checkpoint-{half}")
            t2, _ = make_trainer(a, os.path.join(out, "b"), a.steps, comm, seed_model=7)
            t2.train(resume_from_checkpoint=ckpt)
            h2 = param_hash(t2.model)
            identical = (h2 == h)
            agreed = torch.tensor([1.0 if identical else 0.0])
            comm.all_reduce(agreed, op="min")
            print(f"rank {rank}: resume from {os.path.basename(ckpt)} bit-identical to the "
                  f"uninterrupted run: {identical}")
            if rank == 0:
                print(f"resume bit-identical on every rank: {bool(agreed[0] == 1.0)}")
            ok = ok and bool(agreed[0] == 1.0)
            if isinstance(t2, ScapeTrainer):
                scape_optimizer(t2.optimizer).destroy()
        elif isinstance(t, ScapeTrainer):
            scape_optimizer(t.optimizer).destroy()
    finally:
        comm.barrier()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    comm.destroy()
    torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
