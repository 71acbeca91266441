"""Rank-side cases of the ScapeAdamS tests (called from rank_worker.py)."""
from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, List

import numpy as np
import torch

import scape
from scape.optim import ScapeAdamS

RANK = int(os.environ["RANK"])
SIZE = int(os.environ["WORLD_SIZE"])


def tiny_model(seed: int = 0, width: int = 12) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, width), torch.nn.LayerNorm(width),
                               torch.nn.Tanh(), torch.nn.Linear(width, 3))


def data(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 7, generator=g)
    y = torch.stack([x[:, :3].sum(1), x[:, 3:].prod(1), x[:, 0] - x[:, 6]], 1)
    return x, y


def flat_hash(m: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in m.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def grads_of(m, step, rank) -> List[np.ndarray]:
    """The gradient rank `rank` computes at `step` for the current parameters (a copy)."""
    import copy

    mm = copy.deepcopy(m)
    for p in mm.parameters():
        p.grad = None
    x, y = data(step, rank)
    torch.nn.functional.mse_loss(mm(x), y).backward()
    return [p.grad.detach().numpy().astype(np.float64).copy() for p in mm.parameters()]


def case_optim_dense_reference(comm, steps=6):
    """Density 1, replicated: the library's step against an independent float64 AdamS, with a
    learning-rate schedule driven through param_groups by a torch LR scheduler."""
    m = tiny_model()
    lr0, b1, b2, eps, wd = 0.01, 0.9, 0.95, 1e-8, 0.05
    opt = ScapeAdamS(m.parameters(), comm, lr=lr0, betas=(b1, b2), eps=eps, weight_decay=wd,
                     density=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    flat = opt.flat_parameters()[0]
    for p in m.parameters():  # parameters and gradients are views into the flat buffers
        assert flat.data_ptr() <= p.data_ptr() < flat.data_ptr() + 4 * flat.numel()
    theta = [p.detach().numpy().astype(np.float64).copy() for p in m.parameters()]
    mom = [np.zeros_like(t) for t in theta]
    theta0 = [t.copy() for t in theta]
    worst = 0.0
    for step in range(steps):
        lr = opt.param_groups[0]["lr"]
        gs = [grads_of(m, step, r) for r in range(SIZE)]
        opt.zero_grad()
        x, y = data(step, RANK)
        torch.nn.functional.mse_loss(m(x), y).backward()
        gflat = opt._groups[0].grad  # backward accumulated into the flat gradient's views
        for p in m.parameters():
            assert gflat.data_ptr() <= p.grad.data_ptr() < gflat.data_ptr() + 4 * gflat.numel()
        opt.step()
        sched.step()
        for i in range(len(theta)):
            g = sum(gr[i] for gr in gs) / SIZE
            m_new = b1 * mom[i] + (1 - b1) * g
            v = b2 * mom[i] ** 2 + (1 - b2) * g ** 2
            theta[i] = theta[i] * (1 - lr * wd) - lr * m_new / (np.sqrt(v) + eps)
            mom[i] = m_new
        for t, p in zip(theta, m.parameters()):
            err = float(np.max(np.abs(p.detach().numpy() - t)))
            worst = max(worst, err)
            if err > 1e-5:
                raise AssertionError(f"step {step}: parameters differ from the float64 AdamS "
                                     f"reference by {err}")
    moved = max(float(np.max(np.abs(t - t0))) for t, t0 in zip(theta, theta0))
    assert moved > 1e-3, f"the parameters hardly moved ({moved}): the check proves nothing"
    info = opt.info()[0]
    assert info["step"] == steps and info["density"] == 1.0, info
    dense_count = sum(p.numel() for p in m.parameters() if p.dim() <= 1)
    assert info["dense_count"] == dense_count, (info["dense_count"], dense_count)
    opt.destroy()
    return {"hash": flat_hash(m), "worst": worst, "lr_last": opt.param_groups[0]["lr"]}


def train(comm, steps, **kw):
    m = tiny_model(width=kw.pop("width", 12))
    opt = ScapeAdamS(m.parameters(), comm, lr=kw.pop("lr", 0.02), **kw)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = data(step, RANK)
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        losses.append(float(loss))
        opt.step()
    return m, opt, losses


def case_optim_sharded_matches_replicated(comm, steps=8):
    out = {}
    for sharded in (False, True):
        m, opt, _ = train(comm, steps, density=0.2, warmup_steps=3, sharded=sharded,
                          mask_ownership="shards", max_grad_norm=0.5, width=40)
        out["sharded" if sharded else "replicated"] = flat_hash(m)
        opt.destroy()
    assert out["sharded"] == out["replicated"], "sharded state gave other bits than replicated"
    # the default dense rule and its override
    m = tiny_model()
    o1 = ScapeAdamS(m.parameters(), comm, density=0.1)
    o2 = ScapeAdamS(tiny_model().parameters(), comm, density=0.1, dense=lambda p: False)
    o3 = ScapeAdamS([{"params": list(tiny_model().parameters()), "dense": True}], comm,
                    density=0.1)
    n = sum(p.numel() for p in m.parameters())
    d1 = o1.info()[0]  # before the first step the info already has the layout's counts
    for o in (o1, o2, o3):
        o.zero_grad()
        o.step()
    c = [o.info()[0]["dense_count"] for o in (o1, o2, o3)]
    assert c[0] == sum(p.numel() for p in m.parameters() if p.dim() <= 1), c
    assert c[1] == 0 and c[2] == n, (c, n)
    del d1
    for o in (o1, o2, o3):
        o.destroy()
    return {"hash": out["sharded"], "dense_counts": c}


def case_optim_config_fields(comm, steps=7):
    """Every configuration field reaches the library: the density schedule and the mask size
    per step, the clipping, and the payload type's bytes."""
    import math

    rho, w = 0.1, 4
    sent = {}
    for payload in (torch.float32, torch.bfloat16):
        m, opt, _ = train(comm, 0, density=rho, warmup_steps=w, max_grad_norm=1e-3,
                          payload_dtype=payload, width=40)
        params = list(m.parameters())
        for step in range(steps):
            opt.zero_grad()
            x, y = data(step, RANK)
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            i = opt.info()[0]
            want_rho = 1.0 if step == 0 else (rho ** (step / w) if step < w else rho)
            assert abs(i["density"] - want_rho) < 1e-12, (step, i["density"], want_rho)
            if step > 0:  # segment ownership: whole tensors are the selection pieces
                k = sum(p.numel() if p.dim() <= 1 else max(1, math.floor(want_rho * p.numel()))
                        for p in params)
                assert i["mask_count"] == k, (step, i["mask_count"], k)
            assert i["grad_norm"] > 1e-3 and abs(i["clip_scale"] - 1e-3 / i["grad_norm"]) < 1e-4, i
        sent[str(payload)] = i["payload_bytes"] + i["dense_bytes"]
        opt.destroy()
    ratio = sent["torch.bfloat16"] / sent["torch.float32"]
    assert abs(ratio - 0.5) < 0.01, sent
    return {"hash": flat_hash(m), "ratio": ratio}


def case_optim_checkpoint(comm, steps=5):
    """state_dict at step k, continue to 2k; a fresh optimizer loaded from the state_dict
    (and the model's state_dict) continues to the same bits."""
    import copy

    m, opt, _ = train(comm, steps, density=0.1, warmup_steps=4, payload_dtype=torch.bfloat16)
    sd_opt = copy.deepcopy(opt.state_dict())
    sd_model = copy.deepcopy(m.state_dict())

    def cont(model, o, start):
        for step in range(start, start + steps):
            o.zero_grad()
            x, y = data(step, RANK)
            torch.nn.functional.mse_loss(model(x), y).backward()
            o.step()

    cont(m, opt, steps)
    want = flat_hash(m)
    m2 = tiny_model(seed=99)  # other initial values: everything must come from the checkpoint
    o2 = ScapeAdamS(m2.parameters(), comm, lr=0.5, density=0.1, warmup_steps=4,
                    payload_dtype=torch.bfloat16, broadcast_parameters=False)
    m2.load_state_dict(sd_model)
    o2.load_state_dict(sd_opt)
    assert o2.param_groups[0]["lr"] == sd_opt["param_groups"][0]["lr"]
    cont(m2, o2, steps)
    got = flat_hash(m2)
    assert got == want, "resumed run differs from the uninterrupted one"
    # a corrupted checkpoint on one rank: every rank raises, nothing changes
    bad = copy.deepcopy(sd_opt)
    if RANK == SIZE - 1:
        blob = bad["scape"]["checkpoints"][0]
        blob[len(blob) // 2] ^= 0xFF
    before = flat_hash(m2)
    try:
        o2.load_state_dict(bad)
    except scape.ScapeError as e:
        err = [type(e).__name__, str(e)]
    else:
        raise AssertionError("a corrupted checkpoint was accepted")
    cont(m2, o2, 2 * steps)  # still usable, on every rank
    after = flat_hash(m2)
    assert before != after
    opt.destroy()
    o2.destroy()
    return {"hash": after, "error": err}


def case_optim_errors(comm):
    m = tiny_model()
    errs: Dict[str, Any] = {}

    def expect(name, fn, cls=scape.InvalidArgumentError):
        try:
            fn()
        except cls as e:
            errs[name] = [type(e).__name__, getattr(e, "argument", None), str(e)]
        else:
            raise AssertionError(f"{name}: no exception")

    expect("dtype", lambda: ScapeAdamS([torch.zeros(3, dtype=torch.float64,
                                                    requires_grad=True)], comm))
    expect("density", lambda: ScapeAdamS(m.parameters(), comm, density=0.0))
    expect("betas", lambda: ScapeAdamS(m.parameters(), comm, betas=(0.9, 1.0)))
    expect("payload", lambda: ScapeAdamS(m.parameters(), comm, payload_dtype=torch.int8))
    expect("comm", lambda: ScapeAdamS(m.parameters(), "comm"))
    opt = ScapeAdamS(m.parameters(), comm, density=0.5)
    opt.param_groups[0]["density"] = 0.3
    expect("changed", opt.step)
    opt.param_groups[0]["density"] = 0.5
    opt.zero_grad()
    opt.step()
    # a library error with the library's message: ranks that disagree on the layout
    m_bad = tiny_model(width=12 + (RANK == 0))
    expect("layout", lambda: ScapeAdamS(m_bad.parameters(), comm, density=0.5,
                                        broadcast_parameters=False),
           cls=scape.ScapeError)
    opt.destroy()
    return {"errors": errs}


def case_optim_entering(comm, steps=10):
    """entering="segment_rms" (issue 23): sharded == replicated, differs from the paper's
    form, survives state_dict / load_state_dict bit for bit, a bad value is refused."""
    import copy

    kw = dict(density=0.2, warmup_steps=3, mask_ownership="shards", max_grad_norm=0.5, width=40)
    hashes = {}
    for name, extra in (("replicated", {}), ("sharded", {"sharded": True})):
        m, opt, _ = train(comm, steps, entering="segment_rms", **kw, **extra)
        hashes[name] = flat_hash(m)
        assert opt.param_groups[0]["entering"] == "segment_rms"
        opt.destroy()
    assert hashes["sharded"] == hashes["replicated"], "sharded != replicated"
    m, opt, _ = train(comm, steps, **kw)
    assert flat_hash(m) != hashes["replicated"], "segment_rms changed nothing"
    opt.destroy()
    # resume: a state_dict at steps // 2, loaded into an optimizer built with the default
    m, opt, _ = train(comm, steps // 2, entering="segment_rms", **kw)
    sd_opt, sd_model = copy.deepcopy(opt.state_dict()), copy.deepcopy(m.state_dict())
    opt.destroy()
    kw2 = dict(kw)
    m2 = tiny_model(seed=5, width=kw2.pop("width"))
    o2 = ScapeAdamS(m2.parameters(), comm, lr=0.02, broadcast_parameters=False, **kw2)
    m2.load_state_dict(sd_model)
    o2.load_state_dict(sd_opt)
    assert o2.param_groups[0]["entering"] == "segment_rms"
    for step in range(steps // 2, steps):
        o2.zero_grad()
        x, y = data(step, RANK)
        torch.nn.functional.mse_loss(m2(x), y).backward()
        o2.step()
    assert flat_hash(m2) == hashes["replicated"], "resumed segment_rms run differs"
    o2.destroy()
    # "segment_rms_masked" (issue 30, momentum factor masking): sharded == replicated, not
    # segment_rms's result, and its state_dict names it
    masked = {}
    for name, extra in (("replicated", {}), ("sharded", {"sharded": True})):
        m, opt, _ = train(comm, steps, entering="segment_rms_masked", **kw, **extra)
        masked[name] = flat_hash(m)
        assert opt.state_dict()["param_groups"][0]["entering"] == "segment_rms_masked"
        opt.destroy()
    assert masked["sharded"] == masked["replicated"], "segment_rms_masked: sharded != replicated"
    assert masked["replicated"] != hashes["replicated"], "momentum factor masking changed nothing"
    try:
        ScapeAdamS(tiny_model().parameters(), comm, entering="residual")
    except scape.InvalidArgumentError as e:
        err = [type(e).__name__, getattr(e, "argument", None)]
    else:
        raise AssertionError("entering='residual' was accepted")
    return {"hash": hashes["replicated"], "masked_hash": masked["replicated"], "error": err}


# the cases of test_optim_api.py join CASES
from optim_api_worker import (case_optim_clip_norm, case_optim_global_clip,  # noqa: E402,F401
                              case_optim_gradscaler, case_optim_hyper_errors,
                              case_optim_nonfinite, case_optim_onecycle,
                              case_optim_payload_types, case_optim_warmup_fraction)
# the mixed-precision cases (test_optim_mixed.py) live in their own module
from optim_mixed_worker import CASES as _MIXED_CASES  # noqa: E402

CASES = {k[5:]: v for k, v in dict(globals()).items() if k.startswith("case_")}
CASES.update(_MIXED_CASES)
from optim_torchlike_worker import CASES as _TORCHLIKE_CASES  # noqa: E402

CASES.update(_TORCHLIKE_CASES)


def run(case: str, outdir: str, args: List[str]):
    comm = scape.Communicator.from_env()
    try:
        res = CASES[case](comm, *[int(a) for a in args])
    except BaseException:
        comm.abort()
        raise
    comm.destroy()
    return res
