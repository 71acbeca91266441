"""A plain training loop with ScapeAdamS and no torch process group: the route of
docs/frameworks.md section 7.3.

    HF_HUB_OFFLINE=1 python3 -m scape.launch -n 2 examples/plain_loop_scape.py
    (or: torchrun --nproc-per-node 2 examples/plain_loop_scape.py)

The SCAPE communicator is the only one: `scape.Communicator.from_env()` reads the launcher's
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; `scape.integrations.distributed_sampler` gives
each rank its shard of the data from the communicator's rank and size (torch's
DistributedSampler, without `init_process_group`); no DDP. Checks (exit status 1 otherwise):
the loss falls, the parameters are bit-identical on every rank, and torch.distributed was never
initialised.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt2 import MotifDataset, all_equal_over, param_hash, tiny_gpt2  # noqa: E402

import scape  # noqa: E402
from scape.integrations import distributed_sampler  # noqa: E402
from scape.optim import ScapeAdamS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16, help="per rank")
    a = ap.parse_args()

    comm = scape.Communicator.from_env()
    model = tiny_gpt2()
    opt = ScapeAdamS(model.parameters(), comm, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01,
                     density=a.density, warmup_steps=10, max_grad_norm=1.0)
    ds = MotifDataset(2048)
    sampler = distributed_sampler(ds, comm, shuffle=True, seed=0)
    dl = torch.utils.data.DataLoader(ds, batch_size=a.batch, sampler=sampler)
    losses, step, epoch = [], 0, 0
    while step < a.steps:
        sampler.set_epoch(epoch)
        for batch in dl:
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
            step += 1
            if step == a.steps:
                break
        epoch += 1
    same = all_equal_over(comm, param_hash(model))
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    no_pg = not torch.distributed.is_initialized()
    if comm.rank == 0:
        print(f"plain loop: density {a.density} steps {a.steps} ranks {comm.size} "
              f"({len(sampler)} samples per rank per epoch)")
        print(f"loss first {first:.4f} last {last:.4f}")
        print(f"bytes sent per step (rank 0): {opt.bytes_sent()}")
        print(f"torch process group: {'none' if no_pg else 'initialised'}")
        print(f"ranks identical: {same}")
    opt.destroy()
    comm.destroy()
    return 0 if same and last < first and no_pg else 1


if __name__ == "__main__":
    sys.exit(main())
