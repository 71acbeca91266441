"""Rank-side cases of test_optim_api.py (issue 22): hyperparameters read from the param groups
at every step (torch schedulers), and GradScaler. Imported by optim_worker.py, whose run()
dispatches them."""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
from ctypes import POINTER, byref, c_float, c_int, c_uint8, c_uint64, c_void_p
from typing import Any, Dict, List
from unittest import mock

import torch

from scape import optim as so
from scape.optim import ScapeAdamS

RANK = int(os.environ["RANK"])
SIZE = int(os.environ["WORLD_SIZE"])


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 12), torch.nn.LayerNorm(12), torch.nn.Tanh(),
                               torch.nn.Linear(12, 3))


def _loss(m: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 7, generator=g)
    y = torch.stack([x[:, :3].sum(1), x[:, 3:].prod(1), x[:, 0] - x[:, 6]], 1)
    return torch.nn.functional.mse_loss(m(x), y)


def _hash(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


KW = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, density=0.3)


def _raw_run(comm, schedule: List[List[float]]) -> str:
    """The same training through the C API directly (ctypes, no ScapeAdamS): the model's
    parameters flattened by hand, the per-step values set with the single setters."""
    L = so._L()
    p = c_void_p
    for name in ("scapeOptimSetBeta1", "scapeOptimSetBeta2", "scapeOptimSetEps",
                 "scapeOptimSetWeightDecay"):
        f = getattr(L, name)
        f.restype, f.argtypes = c_int, [p, c_float]
    m = _model()
    params = list(m.parameters())
    offs = [0]
    for q in params:
        offs.append(offs[-1] + q.numel())
    n = offs[-1]
    flat = torch.empty(n, dtype=torch.float32)
    grad = torch.zeros(n, dtype=torch.float32)
    for q, a, b in zip(params, offs, offs[1:]):
        flat[a:b].copy_(q.detach().reshape(-1))
        q.data = flat[a:b].view_as(q)
        q.grad = grad[a:b].view_as(q)
    cfg = so._OptimConfig()
    assert L.scapeOptimConfigInit(byref(cfg)) == 0
    c_offs = (c_uint64 * len(offs))(*offs)
    c_dense = (c_uint8 * len(params))(*[1 if q.dim() <= 1 else 0 for q in params])
    cfg.n, cfg.nsegments = n, len(params)
    cfg.segOffsets = ctypes.cast(c_offs, POINTER(c_uint64))
    cfg.denseFlags = ctypes.cast(c_dense, POINTER(c_uint8))
    cfg.lr, cfg.beta1, cfg.beta2 = KW["lr"], KW["betas"][0], KW["betas"][1]
    cfg.eps, cfg.weightDecay, cfg.density = KW["eps"], KW["weight_decay"], KW["density"]
    h = c_void_p()
    assert L.scapeOptimCreate(byref(h), byref(cfg), comm._check_alive("raw")) == 0
    try:
        for s, (lr, b1, b2, eps, wd) in enumerate(schedule):
            grad.zero_()
            _loss(m, s, RANK).backward()
            assert L.scapeOptimSetLr(h, lr) == 0
            assert L.scapeOptimSetBeta1(h, b1) == 0
            assert L.scapeOptimSetBeta2(h, b2) == 0
            assert L.scapeOptimSetEps(h, eps) == 0
            assert L.scapeOptimSetWeightDecay(h, wd) == 0
            assert L.scapeOptimStep(h, flat.data_ptr(), grad.data_ptr(), n) == 0
    finally:
        L.scapeOptimDestroy(h)
    return _hash([flat])


def case_optim_onecycle(comm, steps=20):
    """OneCycleLR with its default cycle_momentum=True (it cycles beta1) for `steps` steps,
    against the same values set through the C API directly, and against a run without
    momentum cycling (which must differ: beta1 reached the library)."""
    def scheduled(cycle: bool):
        m = _model()
        opt = ScapeAdamS(m.parameters(), comm, **KW)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=steps,
                                                    cycle_momentum=cycle)
        seen = []
        for s in range(steps):
            opt.zero_grad()
            _loss(m, s, RANK).backward()
            pg = opt.param_groups[0]
            seen.append([pg["lr"], pg["betas"][0], pg["betas"][1], pg["eps"],
                         pg["weight_decay"]])
            opt.step()
            sched.step()
        out = _hash(opt.flat_parameters())
        opt.destroy()
        return out, seen

    h_sched, seen = scheduled(True)
    b1s = sorted({round(v[1], 6) for v in seen})
    assert len(b1s) >= 10, f"OneCycleLR did not cycle beta1: {b1s}"
    h_raw = _raw_run(comm, seen)
    h_nocycle, _ = scheduled(False)
    return {"hash": h_sched, "raw": h_raw, "nocycle": h_nocycle, "beta1": [v[1] for v in seen]}


def case_optim_hyper_errors(comm):
    """Bad values in a param group raise at the next step naming the key; nothing changes."""
    m = _model()
    opt = ScapeAdamS(m.parameters(), comm, **KW)
    errs: Dict[str, Any] = {}
    before = _hash(opt.flat_parameters())
    for key, val in (("betas", (1.0, 0.95)), ("betas", (0.9,)), ("eps", -1.0),
                     ("weight_decay", float("nan")), ("lr", float("inf"))):
        pg = opt.param_groups[0]
        old = pg[key]
        pg[key] = val
        try:
            opt.step()
        except Exception as e:  # noqa: BLE001 - recorded for the parent
            errs.setdefault(key, []).append([type(e).__name__, getattr(e, "argument", None)])
        else:
            raise AssertionError(f"{key} = {val!r}: no exception")
        pg[key] = old
    # lr * weight_decay >= 1: the library refuses the pair
    opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"] = 2.0, 0.6
    try:
        opt.step()
    except Exception as e:  # noqa: BLE001
        errs["pair"] = [type(e).__name__, str(e)]
    assert _hash(opt.flat_parameters()) == before, "a refused step changed the parameters"
    opt.destroy()
    return {"errors": errs}


class _CpuGradScaler(torch.cuda.amp.GradScaler):
    """torch's GradScaler (1.13) on CPU tensors, for the tests only: torch 1.13 has CPU kernels
    for neither the unscale nor the scale update, and disables the scaler without CUDA. The
    state machine (scale, unscale_, step, update, found_inf bookkeeping) is torch's; the two
    kernels are replaced by the same arithmetic on CPU."""

    def __init__(self, **kw):
        with mock.patch("torch.cuda.is_available", lambda: True):
            super().__init__(**kw)

    def scale(self, outputs):
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(outputs.device)
        return outputs * self._scale

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        for group in optimizer.param_groups:
            for q in group["params"]:
                if q.grad is not None:
                    q.grad.mul_(inv_scale)  # in place, as torch's kernel
                    if not bool(torch.isfinite(q.grad).all()):
                        found_inf.fill_(1.0)
        return {found_inf.device: found_inf}

    def update(self, new_scale=None):
        def upd(scale, tracker, found, growth, backoff, interval):
            if float(found) > 0:
                scale.mul_(backoff)
                tracker.zero_()
            else:
                tracker.add_(1)
                if int(tracker) == interval:
                    scale.mul_(growth)
                    tracker.zero_()
            return scale

        with mock.patch.object(torch, "_amp_update_scale_", upd):
            super().update(new_scale)


def case_optim_gradscaler(comm, steps=6, bad_step=3):
    """GradScaler.step(optimizer): one rank's inf at `bad_step` skips that step on every rank
    (not only on the rank that found it: that would leave the others waiting in the step's
    collectives) and halves the scale on every rank; otherwise the unscaled (power-of-two)
    gradients give the bits of a run without a scaler that never took the bad step. The real
    torch.cuda.amp.GradScaler, disabled on a machine without CUDA, passes step() through."""
    def run(mode: str):
        m = _model()
        opt = ScapeAdamS(m.parameters(), comm, **KW)
        scales = []
        if mode == "scaler":
            scaler = _CpuGradScaler(init_scale=2.0 ** 12, growth_interval=2)
        elif mode == "disabled":
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scaler = torch.cuda.amp.GradScaler()
            assert not scaler.is_enabled()
        for s in range(steps):
            opt.zero_grad()
            loss = _loss(m, s, RANK)
            if mode in ("plain", "plain_all"):
                loss.backward()
                if s != bad_step or mode == "plain_all":
                    opt.step()
                continue
            if mode == "scaler" and s == bad_step and RANK == SIZE - 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if mode == "scaler":
                scales.append(float(scaler.get_scale()))
        out = _hash(opt.flat_parameters())
        opt.destroy()
        return out, scales

    h_scaler, scales = run("scaler")
    h_plain, _ = run("plain")
    h_disabled, _ = run("disabled")
    h_all, _ = run("plain_all")
    return {"hash": h_scaler, "plain": h_plain, "disabled": h_disabled, "plain_all": h_all,
            "scales": scales}


def case_optim_nonfinite(comm, steps=6, bad_step=3):
    """An inf in the last rank's gradient at `bad_step`: nonfinite="skip" (default) skips the
    step on every rank (parameters unchanged, counted in skipped_steps) and the run gives the
    bits of one that never took it; nonfinite="error" raises on every rank, changing nothing."""
    import scape

    def run(mode: str):
        m = _model()
        kw = dict(KW)
        if mode != "plain":
            kw["nonfinite"] = mode
        opt = ScapeAdamS(m.parameters(), comm, **kw)
        err = None
        for s in range(steps):
            opt.zero_grad()
            _loss(m, s, RANK).backward()
            if s == bad_step:
                if mode == "plain":
                    continue
                if RANK == SIZE - 1:
                    next(m.parameters()).grad[0, 0] = float("inf")
                before = _hash(opt.flat_parameters())
                try:
                    opt.step()
                except scape.InvalidArgumentError as e:
                    err = [type(e).__name__, str(e)]
                assert _hash(opt.flat_parameters()) == before, "the bad step changed params"
                info = opt.info()[0]
                assert info["step"] == bad_step, info["step"]
                assert info["skipped_steps"] == (1 if mode == "skip" else 0), info
                continue
            opt.step()
            info = opt.info()[0]  # the part of sync_wait blocked on the mask sync
            assert 0.0 <= info["mask_wait_seconds"] <= info["phase_seconds"]["sync_wait"], info
        out = _hash(opt.flat_parameters())
        skipped = opt.info()[0]["skipped_steps"]
        opt.destroy()
        return out, err, skipped

    h_skip, e_skip, n_skip = run("skip")
    h_err, e_err, _ = run("error")
    h_plain, _, _ = run("plain")
    try:
        ScapeAdamS(_model().parameters(), comm, nonfinite="drop")
    except scape.InvalidArgumentError as e:
        bad_kw = e.argument
    return {"hash": h_skip, "plain": h_plain, "error_hash": h_err, "skip_error": e_skip,
            "error": e_err, "skipped": n_skip, "bad_kw": bad_kw}


def case_optim_global_clip(comm, steps=3):
    """Issue 32: max_grad_norm is one norm over every param group and rank. Three groups with
    their own lr and weight decay, dense (density 1: the recovered gradient is the ranks'
    average), clipped hard: each step's ``grad_norm`` and ``clip_scale`` against
    torch.nn.utils.clip_grad_norm_ over every parameter's averaged gradient; every group's
    factor is that one. A group that sets its own max_grad_norm is refused."""
    import scape

    m = _model(3)
    lin1, norm, lin2 = m[0], m[1], m[3]
    groups = [{"params": [lin1.weight, lin2.weight], "weight_decay": 0.1},
              {"params": [lin1.bias, lin2.bias], "weight_decay": 0.0, "lr": 0.02},
              {"params": list(norm.parameters()), "weight_decay": 0.0, "lr": 0.005}]
    max_norm = 1e-3
    opt = ScapeAdamS(groups, comm, lr=0.01, density=1.0, max_grad_norm=max_norm)
    params = [p for g in groups for p in g["params"]]
    rows = []
    for s in range(steps):
        opt.zero_grad()
        _loss(m, s, RANK).backward()
        # the reference: the ranks' average of every gradient, clipped as torch does
        avg = torch.cat([p.grad.reshape(-1) for p in params]).clone()
        comm.all_reduce(avg, op="avg")
        ref = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
        off = 0
        for r, p in zip(ref, params):
            r.grad = avg[off:off + p.numel()].view_as(p).clone()
            off += p.numel()
        total = float(torch.nn.utils.clip_grad_norm_(ref, max_norm))
        opt.step()
        scales = [i["clip_scale"] for i in opt.info()]
        rows.append({"norm": opt.grad_norm, "scale": opt.clip_scale, "ref_norm": total,
                     "ref_scale": max_norm / (total + 1e-6), "group_scales": scales,
                     "group_norms": [i["grad_norm"] for i in opt.info()]})
    h = _hash(opt.flat_parameters())
    # a group added later with its own max_grad_norm is refused and leaves the optimizer as it was
    added = None
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))],
                             "max_grad_norm": 0.5})
    except scape.InvalidArgumentError as e:
        added = [e.argument, len(opt.param_groups), len(opt._groups)]
    opt.destroy()
    bad = None
    try:
        ScapeAdamS([{"params": [lin1.weight]}, {"params": [lin2.weight], "max_grad_norm": 0.5}],
                   comm, max_grad_norm=1.0)
    except scape.InvalidArgumentError as e:
        bad = [e.argument, str(e)]
    return {"rows": rows, "hash": h, "bad": bad, "added": added}


def case_optim_clip_norm(comm, steps=4):
    """Issue 30: clip_norm="staying" measures max_grad_norm over the coordinates that stay in
    the mask. At step 0 none stays (every momentum is 0), so it does not clip where the
    recovered-gradient norm does; the runs differ; a bad value is refused naming clip_norm.
    clip_norm="local" clips each rank's own gradient: grad_norm and clip_scale are this rank's
    (its gradients' norm as torch computes it, in double), the runs still identical on every
    rank."""
    import scape

    out = {}
    for mode in ("recovered", "staying", "local"):
        m = _model(5)
        opt = ScapeAdamS(m.parameters(), comm, lr=0.01, density=0.3, max_grad_norm=1e-3,
                         clip_norm=mode)
        scales, norms, local = [], [], []
        for s in range(steps):
            opt.zero_grad()
            _loss(m, s, RANK).backward()
            local.append(math.sqrt(sum(float((p.grad.double() ** 2).sum())
                                       for p in m.parameters())))
            opt.step()
            scales.append(opt.clip_scale)
            norms.append(opt.grad_norm)
        out[mode] = {"scales": scales, "norms": norms, "local": local,
                     "hash": _hash(opt.flat_parameters()),
                     "group": opt.param_groups[0]["clip_norm"]}
        opt.destroy()
    try:
        ScapeAdamS(_model().parameters(), comm, clip_norm="entering")
    except scape.InvalidArgumentError as e:
        out["bad"] = e.argument
    return out


def case_optim_warmup_fraction(comm, steps=6):
    """Issue 30 (3d): warmup_fraction=f with total_steps=N is the warm-up over round(f*N)
    steps, bit for bit (the density schedule and the parameters); bad combinations are
    refused naming the argument."""
    import scape

    out = {}
    for name, kw in (("steps", dict(warmup_steps=4)),
                     ("fraction", dict(warmup_fraction=0.4, total_steps=10)),
                     ("none", dict(warmup_steps=0))):
        m = _model(5)
        opt = ScapeAdamS(m.parameters(), comm, lr=0.01, density=0.1, **kw)
        dens = []
        for s in range(steps):
            opt.zero_grad()
            _loss(m, s, RANK).backward()
            opt.step()
            dens.append(opt.info()[0]["density"])
        out[name] = {"density": dens, "hash": _hash(opt.flat_parameters()),
                     "warmup_steps": opt.param_groups[0]["warmup_steps"]}
        opt.destroy()
    bad = []
    for kw in (dict(warmup_fraction=0.1), dict(warmup_fraction=1.5, total_steps=10),
               dict(warmup_fraction="x", total_steps=10), dict(total_steps=0),
               dict(warmup_fraction=0.1, total_steps=100, warmup_steps=3)):
        try:
            ScapeAdamS(_model().parameters(), comm, **kw)
            bad.append(None)
        except scape.InvalidArgumentError as e:
            bad.append(e.argument)
    out["bad"] = bad
    return out


def case_optim_payload_types(comm, steps=6):
    """Issue 33: every payload type trains through ScapeAdamS (names, torch dtypes where torch
    has them), the ranks agree bit for bit, and the payload bytes follow the element size: an
    8-bit payload sends a quarter of fp32's (plus its 4-byte scale agreement); a checkpoint
    keeps the type; a bad name is refused naming payload_dtype."""
    import scape

    out = {}
    for name in ("fp32", "bf16", "e4m3", "e5m2"):
        m = _model(7)
        opt = ScapeAdamS(m.parameters(), comm, lr=0.01, density=0.25, warmup_steps=0,
                         payload_dtype=name)
        losses = []
        for s in range(steps):
            opt.zero_grad()
            loss = _loss(m, s, RANK)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        i = opt.info()[0]
        sd = opt.state_dict()
        out[name] = {"hash": _hash(opt.flat_parameters()), "losses": losses,
                     "payload": i["payload_bytes"], "control": i["control_bytes"],
                     "dtype": str(opt.param_groups[0]["payload_dtype"]),
                     "saved": int(sd["param_groups"][0]["payload_dtype"])}
        opt.destroy()
    try:
        ScapeAdamS(_model().parameters(), comm, payload_dtype="e3m4")
    except scape.InvalidArgumentError as e:
        out["bad"] = e.argument
    return out
