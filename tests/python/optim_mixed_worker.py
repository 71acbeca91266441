"""Rank-side cases of the mixed-precision ScapeAdamS tests (test_optim_mixed.py; dispatched by
rank_worker.py through optim_worker.py): bf16/fp16 parameters with fp32 master weights."""
from __future__ import annotations

import copy
import hashlib
import os
from typing import Any, Dict

import torch

import scape
from scape.optim import ScapeAdamS

RANK = int(os.environ["RANK"])
SIZE = int(os.environ["WORLD_SIZE"])


def model16(dtype: torch.dtype, seed: int = 0, width: int = 40) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(7, width), torch.nn.LayerNorm(width),
                            torch.nn.Tanh(), torch.nn.Linear(width, 3))
    return m.to(dtype)


def data(step: int, rank: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 7, generator=g)
    y = torch.stack([x[:, :3].sum(1), x[:, 3:].prod(1), x[:, 0] - x[:, 6]], 1)
    return x.to(dtype), y.to(dtype)


def bits(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def model_hash(m: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in m.parameters():
        h.update(bits(p))
    return h.hexdigest()


def check_rounded(opt: ScapeAdamS, where: str) -> torch.Tensor:
    """The flat 16-bit parameters must be the masters rounded to nearest even (torch's own
    fp32 -> bf16/fp16 conversion, independent of the library's)."""
    flat = opt.flat_parameters()[0]
    master = opt.master_weights()[0]
    assert master is not None and master.dtype == torch.float32, where
    assert master.numel() == flat.numel(), (where, master.numel(), flat.numel())
    want = master.to(flat.dtype)
    if bits(want) != bits(flat):
        bad = (want.view(torch.int16) != flat.detach().cpu().view(torch.int16)).nonzero()
        raise AssertionError(f"{where}: {bad.numel()} parameters are not the rounded masters, "
                             f"first at {int(bad[0])}")
    return master


def steps_(m, opt, dtype, start, stop, losses=None):
    for step in range(start, stop):
        opt.zero_grad()
        x, y = data(step, RANK, dtype)
        # the loss in fp32 (torch 1.13 has no bf16 mse on the CPU), gradients flow back bf16
        loss = ((m(x).float() - y.float()) ** 2).mean()
        loss.backward()
        if losses is not None:
            losses.append(float(loss))
        opt.step()


def case_optim_mixed_bf16_masters(comm, steps=50, resume=17):
    """A bf16 model with fp32 masters: 50 steps; after every step the bf16 parameters are the
    rounded masters; the masters carry more than bf16 (they are real fp32); state_dict at step
    17 holds them, and a fresh model and optimizer loaded from the two state_dicts reach step 50
    with the same bits."""
    dt = torch.bfloat16
    kw: Dict[str, Any] = dict(lr=0.02, density=0.1, warmup_steps=4, weight_decay=0.01,
                              payload_dtype=torch.bfloat16, max_grad_norm=1.0)
    m = model16(dt)
    opt = ScapeAdamS(m.parameters(), comm, **kw)
    p0 = opt.flat_parameters()[0]
    assert p0.dtype == dt
    for p in m.parameters():  # views into the flat bf16 buffer, gradients too
        assert p0.data_ptr() <= p.data_ptr() < p0.data_ptr() + 2 * p0.numel()
    assert opt.master_weights() == [None], "masters before the first step"
    losses = []
    sd_opt = sd_model = None
    finer = 0
    for step in range(steps):
        if step == resume:
            sd_opt = copy.deepcopy(opt.state_dict())
            sd_model = copy.deepcopy(m.state_dict())
        steps_(m, opt, dt, step, step + 1, losses)
        master = check_rounded(opt, f"step {step}")
        finer = max(finer, int((master != master.to(dt).float()).sum()))
    assert finer > 0, "the masters never held more than bf16: they prove nothing"
    info = opt.info()[0]
    n = opt.flat_parameters()[0].numel()
    # residual and masters (n floats each), the momentum packed at the mask
    assert info["state_bytes"] == 8 * n + 4 * info["mask_count"], info["state_bytes"]
    assert losses[-1] < losses[0], losses
    want = model_hash(m)
    want_master = bits(opt.master_weights()[0])

    # masters in the state_dict, the step-17 parameters are them rounded
    sm = sd_opt["scape"]["master_weights"][0]
    assert sm is not None and sm.dtype == torch.float32 and sm.numel() == n
    flat17 = torch.cat([t.reshape(-1) for t in sd_model.values()])
    assert bits(sm.to(dt)) == bits(flat17), "state_dict masters are not the saved parameters"

    m2 = model16(dt, seed=99)  # other initial values: all must come from the state_dicts
    o2 = ScapeAdamS(m2.parameters(), comm, broadcast_parameters=False, **kw)
    m2.load_state_dict(sd_model)
    o2.load_state_dict(sd_opt)
    steps_(m2, o2, dt, resume, steps)
    got = model_hash(m2)
    assert got == want, "the resumed run differs from the uninterrupted one at step 50"
    assert bits(o2.master_weights()[0]) == want_master, "resumed masters differ"
    opt.destroy()
    o2.destroy()
    return {"hash": want, "master_hash": hashlib.sha256(want_master).hexdigest(),
            "loss0": losses[0], "loss_last": losses[-1]}


def case_optim_mixed_fp16_sharded(comm, steps=12):
    """fp16 parameters, sharded state, fp16 payload: the parameters stay the rounded masters,
    and sharded equals replicated bit for bit. (torch 1.13 has no fp16 matmul on the CPU: the
    gradients are synthetic, per rank and step, written into p.grad.)"""
    dt = torch.float16
    out = {}
    for sharded in (False, True):
        torch.manual_seed(5)
        params = [torch.nn.Parameter((0.5 * torch.randn(*s)).to(dt))
                  for s in ((24, 7), (24,), (3, 24), (3,))]
        m = torch.nn.ParameterList(params)
        opt = ScapeAdamS(m.parameters(), comm, lr=0.01, density=0.2, sharded=sharded,
                         mask_ownership="shards", payload_dtype=torch.float16,
                         weight_decay=0.0)
        for step in range(steps):
            opt.zero_grad()
            g = torch.Generator().manual_seed(7919 * step + RANK)
            for p in m.parameters():
                p.grad.copy_(torch.randn(p.shape, generator=g).to(dt))
            opt.step()
            check_rounded(opt, f"fp16 sharded={sharded} step {step}")
        out[sharded] = (model_hash(m), bits(opt.master_weights()[0]))
        opt.destroy()
    assert out[True] == out[False], "sharded differs from replicated"
    return {"hash": out[True][0]}


def case_optim_mixed_fp32_grads(comm, steps=10):
    """grad_dtype=float32 with a bf16 model (Megatron's main_grad): with one backward per step
    the fp32 gradients are the bf16 ones widened, so the run equals the default (bf16 gradient)
    run bit for bit while going through the library's fp32-gradient path; two micro-batches
    accumulate in fp32 in p.main_grad."""
    dt = torch.bfloat16
    kw: Dict[str, Any] = dict(lr=0.02, density=0.2, weight_decay=0.01,
                              payload_dtype=torch.bfloat16)
    hashes = {}
    for gd in (None, torch.float32):
        m = model16(dt, width=24)
        opt = ScapeAdamS(m.parameters(), comm, grad_dtype=gd, **kw)
        for step in range(steps):
            steps_(m, opt, dt, step, step + 1)
            check_rounded(opt, f"grad_dtype={gd} step {step}")
        hashes[str(gd)] = (model_hash(m), bits(opt.master_weights()[0]))
        if gd is not None:
            ps = list(m.parameters())
            assert all(p.grad is None and p.main_grad.dtype == torch.float32 for p in ps)
            # two micro-batches: main_grad holds their sum in fp32
            opt.zero_grad()
            want = [torch.zeros(p.shape) for p in ps]
            for mb in range(2):
                x, y = data(100 + mb, RANK, dt)
                ((m(x).float() - y.float()) ** 2).mean().backward()
                for w, p in zip(want, ps):
                    w.add_(p.grad.float())
                opt._groups[0].sync_views()  # what step() does first
            for w, p in zip(want, ps):
                assert bits(w) == bits(p.main_grad), "main_grad is not the fp32 sum"
            opt.zero_grad()
            assert all(float(p.main_grad.abs().sum()) == 0.0 for p in ps)
        opt.destroy()
    assert hashes["None"] == hashes["torch.float32"], "fp32 gradients gave other bits"
    return {"hash": hashes["None"][0]}


def case_optim_mixed_errors(comm):
    errs: Dict[str, Any] = {}

    def expect(name, fn, cls=scape.InvalidArgumentError):
        try:
            fn()
        except cls as e:
            errs[name] = [type(e).__name__, getattr(e, "argument", None), str(e)]
        else:
            raise AssertionError(f"{name}: no exception")

    bf = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    fp = torch.zeros(4, dtype=torch.float32, requires_grad=True)
    hf = torch.zeros(4, dtype=torch.float16, requires_grad=True)
    expect("mixed_dtypes", lambda: ScapeAdamS([bf, fp], comm))
    expect("float64", lambda: ScapeAdamS([torch.zeros(3, dtype=torch.float64,
                                                      requires_grad=True)], comm))
    expect("no_masters_16", lambda: ScapeAdamS([bf], comm, master_weights=False))
    expect("masters_fp32", lambda: ScapeAdamS([fp], comm, master_weights=True))
    expect("grad_dtype", lambda: ScapeAdamS([fp], comm, grad_dtype=torch.bfloat16))
    # a group per dtype is fine, each with its own masters rule
    opt = ScapeAdamS([{"params": [bf]}, {"params": [fp]}, {"params": [hf]}], comm, density=1.0)
    for p in (bf, fp, hf):
        p.grad.fill_(1.0)
    opt.step()
    mw = opt.master_weights()
    assert mw[0] is not None and mw[1] is None and mw[2] is not None, mw
    opt.param_groups[0]["master_weights"] = False
    expect("changed", opt.step)
    opt.destroy()
    return {"errors": errs}


CASES = {k[5:]: v for k, v in dict(globals()).items() if k.startswith("case_")}
