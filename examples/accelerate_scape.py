"""accelerate without Trainer, with ScapeAdamS: the route of docs/frameworks.md section 7.2.

    HF_HUB_OFFLINE=1 python3 -m scape.launch -n 2 examples/accelerate_scape.py

`Accelerator.prepare` takes the model, the optimizer (ScapeAdamS), the scheduler and the data
loader as usual (it wraps the model in DDP and shards the data per rank); one call,
`scape.integrations.keep_gradients_local(model)`, stops DDP's gradient all-reduce, because
ScapeAdamS's step exchanges what must be exchanged. Do not call `accelerator.clip_grad_norm_`:
pass `max_grad_norm` to ScapeAdamS. Checks (exit status 1 otherwise): the loss falls, the
parameters are bit-identical on every rank, no gradient all-reduce ran (torch's profiler) and
DDP's buckets went through the hook.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt2 import MotifDataset, all_equal_over, param_hash, tiny_gpt2  # noqa: E402

from scape.integrations import (communicator, ensure_process_group,  # noqa: E402
                                keep_gradients_local, skip_bool_buffers_in_ddp)
from scape.optim import ScapeAdamS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16, help="per rank")
    a = ap.parse_args()

    ensure_process_group()          # gloo, from the launcher's environment
    accelerator = Accelerator(cpu=True)
    comm = communicator()           # the SCAPE communicator, beside torch's group
    model = skip_bool_buffers_in_ddp(tiny_gpt2())
    opt = ScapeAdamS(model.parameters(), comm, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01,
                     density=a.density, warmup_steps=10, max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.1, 1.0 - s / (2 * a.steps)))
    dl = torch.utils.data.DataLoader(MotifDataset(2048), batch_size=a.batch, shuffle=True)
    model, opt, sched, dl = accelerator.prepare(model, opt, sched, dl)
    keep_gradients_local(model)     # DDP keeps each rank's gradients: ScapeAdamS exchanges

    ntensors = len(list(model.parameters()))
    losses, grad_allreduces = [], 0
    it = iter(dl)
    for step in range(a.steps):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(dl)
            batch = next(it)
        with torch.autograd.profiler.profile(record_shapes=True) as prof:
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        grad_allreduces += sum(1 for e in prof.function_events if e.name == "gloo:all_reduce"
                               and (not e.input_shapes
                                    or torch.Size(e.input_shapes[0]).numel() > ntensors))
        losses.append(float(loss))
    same = all_equal_over(comm, param_hash(model))
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    kept = model._scape_local_grads
    if accelerator.is_main_process:
        print(f"accelerate: density {a.density} steps {a.steps} "
              f"distributed_type {accelerator.distributed_type}")
        print(f"loss first {first:.4f} last {last:.4f}")
        print(f"bytes sent per step (ScapeAdamS, rank 0): {opt.optimizer.bytes_sent()}")
        print(f"dense gradient all-reduces: {grad_allreduces}; DDP buckets kept local: "
              f"{kept['calls']} ({kept['bytes']} bytes)")
        print(f"ranks identical: {same}")
    ok = same and last < first and grad_allreduces == 0 and kept["calls"] >= a.steps
    opt.optimizer.destroy()
    comm.destroy()
    torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
