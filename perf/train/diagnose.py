"""Where SCAPE's gap to dense AdamS comes from: how far a coordinate moves in the step it enters
the mask, against the steps it stays in.

One rank, the `full` shape of train.py, SCAPE at density 0.01 (warm-up 10% of the steps, AdamS's
best peak lr of the recorded sweep). After every step it reads the mask that step used
(scapeOptimGetMask + scapeMaskGetIndices, read after the step) and the parameters' change, and splits the sparse
segments' masked coordinates into those that entered the mask at this step (their momentum was
zero: it is zeroed outside the mask) and those that were in it at the previous step too. For an
entering coordinate AdamS's update has a fixed size whatever residual the payload carried:
m_t = c, g^ = c / (1 - b1), v = (1 - b2) g^2, so |dtheta| = lr (1 - b1) / sqrt(1 - b2) (bias
correction "none", eps and clipping aside). The script prints that prediction beside the
measured median and spread of |dtheta| / lr for both groups, the turnover of the mask, and how
much of the exchanged momentum's magnitude the entering coordinates carried.

    PYTHONPATH=build/python /usr/bin/python3 perf/train/diagnose.py [--steps 150] [--out F.json]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from ctypes import byref, c_uint64, c_void_p

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import data  # noqa: E402
import model as gpt  # noqa: E402
import scape  # noqa: E402
from scape import _lib  # noqa: E402
from scape.optim import ScapeAdamS, _L  # noqa: E402
from train import BETAS, CLIP, PLANS, WEIGHT_DECAY, lr_at  # noqa: E402


def mask_indices(handle: int) -> np.ndarray:
    L = _L()
    mh = c_void_p()
    if L.scapeOptimGetMask(handle, byref(mh)) != 0:
        raise RuntimeError("scapeOptimGetMask failed")
    lib = _lib.lib()
    k = c_uint64()
    if lib.scapeMaskGetCount(mh, byref(k)) != 0:
        raise RuntimeError("scapeMaskGetCount failed")
    out = np.empty(k.value, dtype=np.uint64)
    if k.value and lib.scapeMaskGetIndices(
            mh, out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)), k.value) != 0:
        raise RuntimeError("scapeMaskGetIndices failed")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=PLANS["full"][1])
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ.setdefault("SCAPE_SOCKET_IFNAME", "lo")
    shape = PLANS["full"][0]
    corpus = data.load()
    stream = data.encode(corpus.train_docs)
    torch.manual_seed(args.seed)
    m = gpt.GPT(gpt.GPTConfig(vocab=data.VOCAB, context=shape.context, d_model=shape.d_model,
                              n_layers=shape.n_layers, n_heads=shape.n_heads))
    params = list(m.parameters())
    # Only the sparse segments (matrices) are compared; 1-D tensors are dense by default.
    sparse = np.zeros(sum(p.numel() for p in params), dtype=bool)
    off = 0
    for p in params:
        if p.dim() > 1:
            sparse[off:off + p.numel()] = True
        off += p.numel()
    batches = data.Batches(stream, shape.context, shape.batch * 4, seed=args.seed * 1000)
    b1, b2 = BETAS
    predicted = (1 - b1) / np.sqrt(1 - b2)
    warm = int(0.1 * args.steps)
    rows = []
    with scape.Communicator(1, scape.get_unique_id(), 0) as comm:
        opt = ScapeAdamS(params, comm, lr=args.lr, betas=BETAS, eps=1e-8,
                         weight_decay=WEIGHT_DECAY, density=args.density, warmup_steps=warm,
                         max_grad_norm=CLIP)
        group = opt._groups[0]
        prev = None
        for step in range(args.steps):
            lr = lr_at(step, args.steps, args.lr)
            for pg in opt.param_groups:
                pg["lr"] = lr
            x, y = batches.next()
            opt.zero_grad()
            loss = m(torch.from_numpy(x), torch.from_numpy(y))
            loss.backward()
            before = group.flat.numpy().copy()
            opt.step()
            # The optimizer's mask after a step is the one that step used (the next one becomes
            # current at the start of the next step).
            used = mask_indices(group.handle)
            after = group.flat.numpy()
            # Decoupled weight decay moves every coordinate by lr*wd*theta: take it out.
            move = np.abs(after - before * (1 - lr * WEIGHT_DECAY)) / lr
            idx = used.astype(np.int64)
            idx = idx[sparse[idx]]
            if prev is not None and len(idx) and step > warm:
                entering = ~np.isin(idx, prev)
                new, old = move[idx[entering]], move[idx[~entering]]
                rows.append({
                    "step": step, "loss": float(loss), "k_sparse": int(len(idx)),
                    "turnover": float(entering.mean()),
                    "enter_median": float(np.median(new)) if len(new) else None,
                    "enter_p10": float(np.percentile(new, 10)) if len(new) else None,
                    "enter_p90": float(np.percentile(new, 90)) if len(new) else None,
                    "stay_median": float(np.median(old)) if len(old) else None,
                    "stay_p10": float(np.percentile(old, 10)) if len(old) else None,
                    "stay_p90": float(np.percentile(old, 90)) if len(old) else None,
                })
            prev = idx
        opt.destroy()
    if not rows:
        print("diagnose: no step after the warm-up")
        return 1

    def med(key):
        v = [r[key] for r in rows if r[key] is not None]
        return float(np.median(v)) if v else float("nan")

    summary = {
        "density": args.density, "steps": args.steps, "lr": args.lr, "warmup_steps": warm,
        "predicted_enter_move_over_lr": float(predicted),
        "median_turnover": med("turnover"),
        "enter_move_over_lr": [med("enter_p10"), med("enter_median"), med("enter_p90")],
        "stay_move_over_lr": [med("stay_p10"), med("stay_median"), med("stay_p90")],
        "steps_measured": len(rows),
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
