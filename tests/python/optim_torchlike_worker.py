"""Rank-side cases of test_optim_torchlike.py: ScapeAdamS behaving like a torch optimizer
(optimizer.state, duplicate parameters, dtype changes, zero_grad(set_to_none=True)) and the
consolidated state_dict that one rank saves for all (called through optim_worker.py)."""
from __future__ import annotations

import copy
import os
import warnings
from typing import Any, Dict

import numpy as np
import torch

import scape
from scape.optim import ScapeAdamS

from optim_worker import RANK, SIZE, data, flat_hash, grads_of, tiny_model  # noqa: E402


def _steps(m, opt, start, steps, set_to_none=False):
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=set_to_none)
        x, y = data(step, RANK)
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()


def case_optim_tl_state(comm, steps=3):
    """optimizer.state[p]: read-only, per parameter, the step counter, the momentum (dense:
    checked against (1 - b1) * the ranks' mean gradient after one dense step) and the
    residual; reading it changes nothing."""
    m = tiny_model()
    opt = ScapeAdamS(m.parameters(), comm, lr=0.01, density=1.0, betas=(0.9, 0.95))
    params = list(m.parameters())
    st = opt.state[params[0]]
    assert float(st["step"]) == 0 and float(st["exp_avg"].abs().sum()) == 0
    want = [np.zeros(p.shape) for p in params]
    for r in range(SIZE):
        for w, g in zip(want, grads_of(m, 0, r)):
            w += g / SIZE
    _steps(m, opt, 0, 1)
    worst = 0.0
    for p, w in zip(params, want):
        s = opt.state[p]
        assert set(s) == {"step", "exp_avg", "residual"}, sorted(s)
        assert s["exp_avg"].shape == p.shape and s["residual"].shape == p.shape
        assert float(s["step"]) == 1
        worst = max(worst, float(np.abs(s["exp_avg"].numpy() - 0.1 * w).max()))
    assert worst < 1e-6, worst
    assert len(opt.state) == len(params) and params[1] in opt.state
    assert torch.zeros(1) not in opt.state
    try:
        opt.state[params[0]] = {}
    except TypeError:
        pass
    else:
        raise AssertionError("optimizer.state accepted an assignment")
    try:
        opt.state[params[0]]["step"] = 5
    except TypeError:
        pass
    else:
        raise AssertionError("optimizer.state[p] accepted an assignment")
    # sparse: the momentum lives at the mask, the residual outside it; reading changes nothing
    m2 = tiny_model()
    o2 = ScapeAdamS(m2.parameters(), comm, lr=0.01, density=0.25, dense=lambda p: False)
    _steps(m2, o2, 0, steps)
    before = flat_hash(m2)
    nz_m = sum(int((o2.state[p]["exp_avg"] != 0).sum()) for p in m2.parameters())
    nz_e = sum(int((o2.state[p]["residual"] != 0).sum()) for p in m2.parameters())
    assert 0 < nz_m <= o2.info()[0]["mask_count"], (nz_m, o2.info()[0]["mask_count"])
    assert nz_e > 0
    assert float(o2.state[next(m2.parameters())]["step"]) == steps
    assert o2.state_dict()["state"] == {}
    _steps(m2, o2, steps, 1)
    assert float(o2.state[next(m2.parameters())]["step"]) == steps + 1
    assert flat_hash(m2) != before
    opt.destroy()
    o2.destroy()
    return {"hash": flat_hash(m2), "worst": worst}


def case_optim_tl_duplicates(comm):
    m = tiny_model()
    w = m[0].weight
    errs = {}
    try:
        ScapeAdamS([w, m[0].bias, w], comm)
    except ValueError as e:
        errs["one_group"] = [type(e).__name__, str(e)]
    try:
        ScapeAdamS([{"params": [w]}, {"params": [m[0].bias, w]}], comm)
    except ValueError as e:
        errs["two_groups"] = [type(e).__name__, str(e)]
    return {"errors": errs}


def case_optim_tl_dtype_change(comm):
    """model.double() after building the optimizer: the next step raises naming the
    parameter (it used to be converted back silently); model.to() of the same dtype is fine."""
    m = tiny_model()
    opt = ScapeAdamS(m.parameters(), comm, lr=0.01, density=0.5)
    _steps(m, opt, 0, 1)
    m.to(torch.float32)
    _steps(m, opt, 1, 1)
    m.double()
    err = None
    try:
        opt.step()
    except scape.InvalidArgumentError as e:
        err = [type(e).__name__, e.argument, str(e)]
    assert err is not None, "a float64 parameter was accepted"
    assert m[0].weight.dtype == torch.float64  # not undone
    opt.destroy()
    # two groups, the second one's parameter converted: no group steps
    m2 = tiny_model()
    o2 = ScapeAdamS([{"params": list(m2[0].parameters())},
                     {"params": list(m2[3].parameters())}], comm, lr=0.01, density=0.5)
    _steps(m2, o2, 0, 1)
    m2[3].bias.data = m2[3].bias.data.double()
    before = [p.detach().clone() for p in m2[0].parameters()]
    err2 = None
    try:
        o2.step()
    except scape.InvalidArgumentError as e:
        err2 = str(e)
    assert err2 is not None and "param group 1, parameter 1 (shape (3,))" in err2, err2
    assert all(torch.equal(a, b) for a, b in zip(before, m2[0].parameters())), \
        "group 0 stepped before group 1's conversion was refused"
    o2.destroy()
    return {"error": err, "error2": err2}


def case_optim_tl_set_to_none(comm, steps=4):
    """zero_grad(set_to_none=True) as torch: p.grad None; a step with None gradients is a
    step with zero gradients; training with it gives the same bits as with zero_grad()."""
    kw = dict(lr=0.02, density=0.3, warmup_steps=2)
    m1 = tiny_model()
    o1 = ScapeAdamS(m1.parameters(), comm, **kw)
    _steps(m1, o1, 0, steps)
    m2 = tiny_model()
    o2 = ScapeAdamS(m2.parameters(), comm, **kw)
    _steps(m2, o2, 0, steps, set_to_none=True)
    assert flat_hash(m1) == flat_hash(m2), "set_to_none changed the training"
    o2.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in m2.parameters())
    o1.zero_grad()
    o1.step()  # zero gradients
    o2.step()  # None gradients
    assert flat_hash(m1) == flat_hash(m2), "a None gradient is not a zero gradient"
    flat = o2._groups[0].grad
    for p, a in zip(m2.parameters(), o2._groups[0].offsets):
        assert p.grad is not None and p.grad.data_ptr() == flat[a:].data_ptr(), "not re-pointed"
    o1.destroy()
    o2.destroy()
    return {"hash": flat_hash(m2)}


def case_optim_tl_consolidated(comm, steps=4):
    """consolidate_state_dict(to=0): rank 0's state_dict resumes every rank bit-identically;
    a dict without rank 1's part is refused on every rank naming rank 1; a stale
    consolidation warns and falls back to the rank's own state."""
    kw = dict(lr=0.02, density=0.2, payload_dtype=torch.bfloat16)
    path = f"/tmp/scape_tl_{os.environ['MASTER_PORT']}.pt"
    m = tiny_model()
    opt = ScapeAdamS([{"params": [p for p in m.parameters() if p.dim() > 1]},
                      {"params": [p for p in m.parameters() if p.dim() <= 1],
                       "weight_decay": 0.0}], comm, **kw)
    _steps(m, opt, 0, steps)
    opt.consolidate_state_dict(to=0)
    sd = opt.state_dict()
    if RANK == 0:
        assert sorted(sd["scape"]["ranks"]) == list(range(SIZE))
        torch.save({"model": m.state_dict(), "opt": sd}, path)
    else:
        assert "ranks" not in sd["scape"]
    comm.barrier()
    _steps(m, opt, steps, steps)
    want = flat_hash(m)
    # stale: a step since the consolidation
    stale = None
    if RANK == 0:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            stale_sd = opt.state_dict()
        assert "ranks" not in stale_sd["scape"]
        stale = str(w[-1].message) if w else None
    saved = torch.load(path)
    m2 = tiny_model(seed=5)
    o2 = ScapeAdamS([{"params": [p for p in m2.parameters() if p.dim() > 1]},
                     {"params": [p for p in m2.parameters() if p.dim() <= 1],
                      "weight_decay": 0.0}], comm, broadcast_parameters=False, **kw)
    m2.load_state_dict(saved["model"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "saved by rank 0" warning on rank 1
        o2.load_state_dict(saved["opt"])
    _steps(m2, o2, steps, steps)
    got = flat_hash(m2)
    assert got == want, f"rank {RANK}: the resume from rank 0's file differs"
    bad = copy.deepcopy(saved["opt"])
    del bad["scape"]["ranks"][SIZE - 1]
    before = flat_hash(m2)
    err = None
    try:
        o2.load_state_dict(bad)
    except scape.InvalidArgumentError as e:
        err = [type(e).__name__, str(e)]
    assert err is not None, "a state_dict without a rank's part was accepted"
    # rank 0's own (not consolidated) state loaded on every rank: refused on both, naming 1
    own = None
    if RANK == 0:
        torch.save(o2.state_dict(), path)
    comm.barrier()
    try:
        o2.load_state_dict(torch.load(path))
    except scape.InvalidArgumentError as e:
        own = [type(e).__name__, str(e)]
    assert own is not None, "rank 0's own state_dict was accepted on every rank"
    _steps(m2, o2, 2 * steps, 1)  # still usable on every rank
    assert flat_hash(m2) != before
    comm.barrier()
    if RANK == 0:
        os.remove(path)
    opt.destroy()
    o2.destroy()
    return {"hash": got, "error": err, "stale": stale, "own": own}


CASES: Dict[str, Any] = {k[5:]: v for k, v in dict(globals()).items() if k.startswith("case_")}
