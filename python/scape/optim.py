"""``ScapeAdamS``: the library's SCAPE-AdamS step as a ``torch.optim.Optimizer``.

The optimizer owns the data-parallel gradient exchange: do **not** all-reduce gradients
yourself (no DistributedDataParallel, no ``all_reduce`` of ``.grad``). Each rank runs forward
and backward on its own data, then ``optimizer.step()`` averages what must be averaged (the
new momentum at the agreed mask, values only) and updates the parameters identically on every
rank. See docs/python.md and docs/frameworks.md.
"""
from __future__ import annotations

import ctypes
import warnings
from ctypes import (POINTER, Structure, byref, c_double, c_float, c_int, c_int64, c_size_t,
                    c_uint, c_uint8, c_uint64, c_void_p)
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch

from . import _lib
from .comm import Communicator
from .errors import SUCCESS, InvalidUsageError, bad_arg
from .types import DataType, MaskEncoding, Ownership, to_enum

__all__ = ["ScapeAdamS", "StepInfo", "dense_by_default"]

OPTIM_CONFIG_MAGIC = 0x5CA90
NUM_PHASES = 7
PHASES = ("sync_wait", "candidate", "select", "exchange", "norm", "update", "gather")
BIAS_CORRECTIONS = {"none": 0, "adams": 1, "artifact": 2}
ENTERINGS = {"payload": 0, "segment_rms": 1}


class _OptimConfig(Structure):
    _fields_ = [
        ("size", c_size_t), ("magic", c_uint), ("n", c_uint64), ("nsegments", c_int),
        ("segOffsets", POINTER(c_uint64)), ("denseFlags", POINTER(c_uint8)),
        ("ownership", c_int), ("maskOwnership", c_int), ("lr", c_float), ("beta1", c_float),
        ("beta2", c_float), ("eps", c_float), ("weightDecay", c_float),
        ("maxGradNorm", c_float), ("biasCorrection", c_int), ("density", c_double),
        ("warmupSteps", c_int64), ("payloadType", c_int), ("maskEncoding", c_int),
        ("entering", c_int),
    ]


class _OptimInfo(Structure):
    _fields_ = [
        ("step", c_int64), ("density", c_double), ("nextDensity", c_double),
        ("maskCount", c_uint64), ("denseCount", c_uint64), ("maskBytes", c_uint64),
        ("payloadBytes", c_uint64), ("denseBytes", c_uint64), ("gradNorm", c_double),
        ("clipScale", c_float), ("stateBytes", c_uint64), ("maskStateBytes", c_uint64),
        ("scratchBytes", c_uint64), ("phaseSeconds", c_double * NUM_PHASES),
    ]


_declared = False


def _L() -> ctypes.CDLL:
    global _declared
    L = _lib.lib()
    if not _declared:
        missing = [f for f in ("scapeOptimConfigInit", "scapeOptimCreate", "scapeOptimStep",
                               "scapeOptimSave", "scapeOptimLoad") if not _lib.has_symbol(f)]
        if missing:
            raise InvalidUsageError(f"the loaded library ({_lib.library_path()}) has no "
                                    f"optimizer step ({', '.join(missing)} missing): rebuild it",
                                    function="ScapeAdamS")
        p = c_void_p

        def d(name, *argtypes):
            f = getattr(L, name)
            f.restype = c_int
            f.argtypes = list(argtypes)

        d("scapeOptimConfigInit", POINTER(_OptimConfig))
        d("scapeOptimCreate", POINTER(p), POINTER(_OptimConfig), p)
        d("scapeOptimDestroy", p)
        d("scapeOptimSetLr", p, c_float)
        d("scapeOptimStep", p, p, p, c_uint64)
        d("scapeOptimGetInfo", p, POINTER(_OptimInfo))
        d("scapeOptimGetMask", p, POINTER(p))
        d("scapeOptimCheckpointSize", p, POINTER(c_size_t))
        d("scapeOptimSave", p, p, c_size_t, POINTER(c_size_t))
        d("scapeOptimLoad", p, p, c_size_t)
        _declared = True
    return L


class StepInfo(dict):
    """What one parameter group's optimizer did in the last step (``scapeOptimGetInfo``), as a
    dict with keys: step, density, next_density, mask_count, dense_count, mask_bytes,
    payload_bytes, dense_bytes, bytes_sent (the sum of the three), grad_norm, clip_scale,
    state_bytes, mask_state_bytes, scratch_bytes, phase_seconds (a dict by phase name)."""


def dense_by_default(param: torch.Tensor) -> bool:
    """The default rule for always-dense tensors: 1-D (and 0-D) parameters, i.e. norms and
    biases, as the SCAPE authors' artifact does by name (layernorm / rmsnorm / bias)."""
    return param.dim() <= 1


class _Group:
    """The library optimizer of one parameter group, its flat parameter and gradient buffers,
    and the views the group's parameters and gradients are."""

    def __init__(self, opt: "ScapeAdamS", group: Dict[str, Any]) -> None:
        self.params: List[torch.Tensor] = list(group["params"])
        self.handle: Optional[int] = None
        self.comm = opt._comm
        sizes = [p.numel() for p in self.params]
        self.n = int(sum(sizes))
        self.offsets = [0]
        for s in sizes:
            self.offsets.append(self.offsets[-1] + s)
        rule = opt._dense_rule
        gd = group.get("dense")
        self.dense = [bool(gd) if gd is not None else bool(rule(p)) for p in self.params]
        self.flat = torch.empty(self.n, dtype=torch.float32)
        self.grad = torch.zeros(self.n, dtype=torch.float32)
        for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
            self.flat[a:b].copy_(p.detach().reshape(-1))
        if opt._broadcast and self.n:
            self.comm.broadcast(self.flat, root=0)
        with torch.no_grad():
            for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
                p.data = self.flat[a:b].view_as(p)
                p.grad = self.grad[a:b].view_as(p)
        self.fixed = {k: group[k] for k in ScapeAdamS._FIXED if k in group}
        self.lr = float(group["lr"])
        if self.n:
            self._create(group)

    def _create(self, group: Dict[str, Any]) -> None:
        L = _L()
        cfg = _OptimConfig()
        self._check(L.scapeOptimConfigInit(byref(cfg)), "scapeOptimConfigInit")
        self._offs = (c_uint64 * len(self.offsets))(*self.offsets)
        self._flags = (c_uint8 * len(self.dense))(*[1 if d else 0 for d in self.dense])
        b1, b2 = group["betas"]
        cfg.n = self.n
        cfg.nsegments = len(self.params)
        cfg.segOffsets = ctypes.cast(self._offs, POINTER(c_uint64))
        cfg.denseFlags = ctypes.cast(self._flags, POINTER(c_uint8))
        cfg.ownership = 1 if group["sharded"] else 0
        mo = group["mask_ownership"]
        cfg.maskOwnership = -1 if mo is None else int(mo)
        cfg.lr = float(group["lr"])
        cfg.beta1, cfg.beta2 = float(b1), float(b2)
        cfg.eps = float(group["eps"])
        cfg.weightDecay = float(group["weight_decay"])
        cfg.maxGradNorm = float(group["max_grad_norm"] or 0.0)
        cfg.biasCorrection = BIAS_CORRECTIONS[group["bias_correction"]]
        cfg.density = float(group["density"])
        cfg.warmupSteps = int(group["warmup_steps"])
        cfg.payloadType = int(group["payload_dtype"])
        cfg.maskEncoding = int(group["mask_encoding"])
        cfg.entering = ENTERINGS[group["entering"]]
        h = c_void_p()
        self._check(L.scapeOptimCreate(byref(h), byref(cfg),
                                       self.comm._check_alive("scapeOptimCreate")),
                    "scapeOptimCreate")
        self.handle = h.value
        # the communicator destroys (or, on abort, forgets) it before itself
        self.comm._masks.add(self)

    def _forget(self) -> None:  # the communicator was aborted: the library freed it
        self.handle = None

    def _check(self, code: int, fn: str) -> None:
        if code != SUCCESS:
            raise self.comm._error(code, fn)

    def sync_views(self) -> None:
        """Re-points parameters and gradients that user code replaced (``p.grad = None``,
        ``p.data = ...``) at the flat buffers, copying their values in."""
        for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
            if p.data_ptr() != self.flat[a:b].data_ptr() or p.data.shape != p.shape:
                self.flat[a:b].copy_(p.detach().reshape(-1))
                p.data = self.flat[a:b].view_as(p)
            g = p.grad
            if g is None:
                self.grad[a:b].zero_()
                p.grad = self.grad[a:b].view_as(p)
            elif g.data_ptr() != self.grad[a:b].data_ptr() or g.shape != p.shape:
                if g.is_sparse:
                    g = g.to_dense()
                self.grad[a:b].copy_(g.reshape(-1))
                p.grad = self.grad[a:b].view_as(p)

    def step(self, lr: float) -> None:
        if self.handle is None:
            return
        L = _L()
        if lr != self.lr:
            self._check(L.scapeOptimSetLr(self.handle, float(lr)), "scapeOptimSetLr")
            self.lr = lr
        self.comm._check_alive("scapeOptimStep")
        self._check(L.scapeOptimStep(self.handle, self.flat.data_ptr(), self.grad.data_ptr(),
                                     self.n), "scapeOptimStep")

    def info(self) -> StepInfo:
        if self.handle is None:
            return StepInfo(step=0, bytes_sent=0, mask_bytes=0, payload_bytes=0,
                            dense_bytes=0, density=1.0, next_density=1.0, mask_count=0)
        i = _OptimInfo()
        self._check(_L().scapeOptimGetInfo(self.handle, byref(i)), "scapeOptimGetInfo")
        return StepInfo(
            step=int(i.step), density=float(i.density), next_density=float(i.nextDensity),
            mask_count=int(i.maskCount), dense_count=int(i.denseCount),
            mask_bytes=int(i.maskBytes), payload_bytes=int(i.payloadBytes),
            dense_bytes=int(i.denseBytes),
            bytes_sent=int(i.maskBytes + i.payloadBytes + i.denseBytes),
            grad_norm=float(i.gradNorm), clip_scale=float(i.clipScale),
            state_bytes=int(i.stateBytes), mask_state_bytes=int(i.maskStateBytes),
            scratch_bytes=int(i.scratchBytes),
            phase_seconds={PHASES[k]: float(i.phaseSeconds[k]) for k in range(NUM_PHASES)})

    def save(self) -> torch.Tensor:
        if self.handle is None:
            return torch.zeros(0, dtype=torch.uint8)
        L = _L()
        size = c_size_t()
        self._check(L.scapeOptimCheckpointSize(self.handle, byref(size)),
                    "scapeOptimCheckpointSize")
        buf = torch.empty(size.value, dtype=torch.uint8)
        written = c_size_t()
        self._check(L.scapeOptimSave(self.handle, buf.data_ptr(), size.value, byref(written)),
                    "scapeOptimSave")
        return buf[:written.value].clone()

    def load(self, blob: torch.Tensor, lr: float) -> None:
        if self.handle is None:
            return
        blob = blob.detach().to(torch.uint8).contiguous()
        self._check(_L().scapeOptimLoad(self.handle, blob.data_ptr() if blob.numel() else None,
                                        blob.numel()), "scapeOptimLoad")
        # the checkpoint's hyperparameters are now in force; make the group's lr the one used
        self._check(_L().scapeOptimSetLr(self.handle, float(lr)), "scapeOptimSetLr")
        self.lr = lr

    def destroy(self) -> None:
        if self.handle is not None:
            h, self.handle = self.handle, None
            self.comm._masks.discard(self)
            if self.comm.alive:
                self._check(_L().scapeOptimDestroy(h), "scapeOptimDestroy")


class ScapeAdamS(torch.optim.Optimizer):
    r"""SCAPE-AdamS: AdamS whose first moment is exchanged sparsely through agreed masks.

    Every step runs, inside the library (``scapeOptimStep``): the wait for the mask chosen
    last step, the candidate ``c = b1*m + (1-b1)*g + e`` with error feedback ``e``, the top-k
    selection of the next mask on this rank's owned part (synchronised in the background), one
    values-only average of the payload, gradient recovery, optional global-norm clipping and
    the AdamS update with decoupled weight decay. Parameters end every step bit-identical on
    every rank. At ``density=1`` it is dense AdamS.

    Each parameter group's parameters are flattened into one fp32 buffer: after construction
    ``p.data`` and ``p.grad`` are views into it, so backward writes gradients straight into
    the buffer the library reads (no copy per step). Keep them that way: ``zero_grad()`` zeroes
    the buffer (``set_to_none`` is ignored); a parameter or gradient that user code replaces
    anyway is copied back in at the next step.

    Args:
        params: parameters or parameter groups (dicts), as for any torch optimizer. CPU fp32
            tensors only. A group may set any keyword below except ``comm``.
        comm: the :class:`scape.Communicator` of the data-parallel ranks.
        lr: learning rate; read from each param group at every step, so LR schedulers and
            manual changes of ``group["lr"]`` take effect.
        betas: (b1, b2), default (0.9, 0.95).
        eps: added outside the square root.
        weight_decay: decoupled (``theta *= 1 - lr*wd`` on every coordinate).
        density: target fraction of each sparse tensor exchanged per step (0 < density <= 1).
        warmup_steps: geometric density warm-up from 1.0 to ``density`` over this many steps
            (0: fixed density from step 1; step 0 is always dense).
        max_grad_norm: clip the recovered gradient to this global L2 norm (0: off). Do not clip
            raw gradients yourself.
        bias_correction: "none" (the AdamS paper, default), "adams" or "artifact".
        payload_dtype: dtype of the exchanged values: torch.float32, torch.bfloat16 or
            torch.float16 (the rounding error goes to the residual).
        sharded: ZeRO-1 style: each rank updates only the masked positions it owns, then the
            updated values are all-gathered (same bits as replicated).
        mask_encoding: "auto", "bitmap", "indices", "elias_fano" or "delta_varint".
        mask_ownership: how mask selection is partitioned between ranks: None (default:
            "segments" replicated, "shards" sharded), "segments" or "shards". Sharded and
            replicated state give the same bits when this is the same.
        dense: None (default: 1-D parameters are always dense, see
            :func:`dense_by_default`), a callable ``param -> bool``, or a collection of the
            parameters to keep dense (all others sparse). A group's ``"dense": True/False``
            overrides it for that group.
        broadcast_parameters: broadcast rank 0's initial parameters to every rank at
            construction (default True), so all ranks start identical.
        entering: the AdamS denominator of a coordinate entering the mask (its previous
            momentum is 0): "payload" (the paper's form, default: it moves
            ``lr*(1-b1)/sqrt(1-b2)`` whatever residual it carries) or "segment_rms" (from the
            mean square of the recovered gradient over the coordinates of the same tensor that
            stay in the mask, so the residual moves it in proportion; capped at 100 lr; issue
            23, docs/ALGORITHM.md section 4.12).

    One library optimizer (and one exchange per step) is created per parameter group, so
    groups may differ in every hyperparameter. After construction, only ``lr`` of a group may
    change; changing another hyperparameter raises at the next step.
    """

    _FIXED = ("betas", "eps", "weight_decay", "density", "warmup_steps", "max_grad_norm",
              "bias_correction", "payload_dtype", "sharded", "mask_ownership", "mask_encoding",
              "dense", "entering")

    def __init__(self, params: Iterable[Any], comm: Communicator, lr: float = 1e-3,
                 betas: Sequence[float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, density: float = 0.01, warmup_steps: int = 0,
                 max_grad_norm: float = 0.0, bias_correction: str = "none",
                 payload_dtype: Union[torch.dtype, str] = torch.float32, sharded: bool = False,
                 mask_encoding: Union[MaskEncoding, str, int] = "auto",
                 mask_ownership: Union[None, Ownership, str, int] = None,
                 dense: Union[None, Callable[[torch.Tensor], bool], Iterable[torch.Tensor]] = None,
                 broadcast_parameters: bool = True, entering: str = "payload") -> None:
        if not isinstance(comm, Communicator):
            raise bad_arg("comm", f"expected a scape.Communicator, got {type(comm).__name__}",
                          type_error=True)
        self._comm = comm
        self._broadcast = bool(broadcast_parameters)
        if dense is None:
            self._dense_rule: Callable[[torch.Tensor], bool] = dense_by_default
        elif callable(dense):
            self._dense_rule = dense
        else:
            ids = {id(p) for p in dense}
            self._dense_rule = lambda p: id(p) in ids
        self._groups: List[_Group] = []
        self._ready = False
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        density=density, warmup_steps=warmup_steps, max_grad_norm=max_grad_norm,
                        bias_correction=bias_correction, payload_dtype=payload_dtype,
                        sharded=sharded, mask_encoding=mask_encoding,
                        mask_ownership=mask_ownership, dense=None, entering=entering)
        super().__init__(params, defaults)
        self._ready = True
        for g in self.param_groups:
            self._groups.append(_Group(self, g))

    # -- groups --------------------------------------------------------------------------

    @staticmethod
    def _normalise(group: Dict[str, Any]) -> None:
        for p in group["params"]:
            if not isinstance(p, torch.Tensor):
                raise bad_arg("params", f"expected tensors, got {type(p).__name__}",
                              type_error=True)
            if p.device.type != "cpu" or p.dtype != torch.float32:
                raise bad_arg("params", f"ScapeAdamS needs CPU float32 parameters, got "
                                        f"{p.dtype} on {p.device}", type_error=True)
            if p.is_sparse:
                raise bad_arg("params", "sparse parameters are not supported", type_error=True)
        try:
            lr = float(group["lr"])
        except (TypeError, ValueError):
            raise bad_arg("lr", f"expected a float, got {group['lr']!r}") from None
        if not lr >= 0.0 or lr != lr:
            raise bad_arg("lr", f"must be >= 0, got {group['lr']!r}")
        betas = group["betas"]
        if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
            raise bad_arg("betas", f"expected two values in [0, 1), got {betas!r}")
        group["betas"] = (float(betas[0]), float(betas[1]))
        for k in ("eps", "weight_decay", "max_grad_norm"):
            v = group[k]
            if v is None and k == "max_grad_norm":
                group[k] = 0.0
                continue
            if not float(v) >= 0.0:
                raise bad_arg(k, f"must be >= 0, got {v!r}")
        d = float(group["density"])
        if not 0.0 < d <= 1.0:
            raise bad_arg("density", f"must be in (0, 1], got {group['density']!r}")
        w = group["warmup_steps"]
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise bad_arg("warmup_steps", f"expected an int >= 0, got {w!r}")
        bc = str(group["bias_correction"]).lower()
        if bc not in BIAS_CORRECTIONS:
            raise bad_arg("bias_correction", f"{group['bias_correction']!r} is not one of "
                                             f"{', '.join(BIAS_CORRECTIONS)}")
        group["bias_correction"] = bc
        en = str(group.get("entering", "payload")).lower()
        if en not in ENTERINGS:
            raise bad_arg("entering", f"{group.get('entering')!r} is not one of "
                                      f"{', '.join(ENTERINGS)}")
        group["entering"] = en
        pd = group["payload_dtype"]
        names = {torch.float32: DataType.FLOAT32, torch.bfloat16: DataType.BFLOAT16,
                 torch.float16: DataType.FLOAT16, "float32": DataType.FLOAT32,
                 "fp32": DataType.FLOAT32, "bfloat16": DataType.BFLOAT16,
                 "bf16": DataType.BFLOAT16, "float16": DataType.FLOAT16,
                 "fp16": DataType.FLOAT16}
        if isinstance(pd, DataType) and pd in (DataType.FLOAT32, DataType.BFLOAT16,
                                               DataType.FLOAT16):
            group["payload_dtype"] = pd
        elif pd in names:
            group["payload_dtype"] = names[pd]
        else:
            raise bad_arg("payload_dtype", f"{pd!r} is not float32, bfloat16 or float16")
        group["mask_encoding"] = to_enum(MaskEncoding, group["mask_encoding"], "mask_encoding")
        group["sharded"] = bool(group["sharded"])
        if group["mask_ownership"] is not None:
            group["mask_ownership"] = to_enum(Ownership, group["mask_ownership"],
                                              "mask_ownership")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Adds a group (collective after construction: every rank must add the same group,
        which creates its library optimizer)."""
        super().add_param_group(param_group)
        self._normalise(self.param_groups[-1])
        if self._ready:
            self._groups.append(_Group(self, self.param_groups[-1]))

    # -- the step ------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zeroes the flat gradient buffers (one fill per group). ``set_to_none`` is ignored:
        the gradients stay views into the buffer the library reads."""
        for g in self._groups:
            g.grad.zero_()
            g.sync_views()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One SCAPE-AdamS step over every group (collective: every rank calls it). Reads each
        group's current ``lr``. Returns the closure's loss, if a closure was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for pg, g in zip(self.param_groups, self._groups):
            for k, v in g.fixed.items():
                if pg.get(k) != v:
                    raise bad_arg(k, f"changed from {v!r} to {pg.get(k)!r} after construction; "
                                     f"only lr may change (the library optimizer is fixed)")
            lr = float(pg["lr"])
            if not lr >= 0.0:
                raise bad_arg("lr", f"must be >= 0, got {pg['lr']!r}")
            g.sync_views()
            g.step(lr)
        return loss

    # -- introspection -------------------------------------------------------------------

    @property
    def comm(self) -> Communicator:
        return self._comm

    def info(self) -> List[StepInfo]:
        """One :class:`StepInfo` per parameter group: what its last step did."""
        return [g.info() for g in self._groups]

    def bytes_sent(self) -> int:
        """Bytes this rank sent in the last step, all groups (mask + payload + dense)."""
        return sum(i["bytes_sent"] for i in self.info())

    def flat_parameters(self) -> List[torch.Tensor]:
        """The flat fp32 parameter buffer of each group (the parameters are views into it)."""
        return [g.flat for g in self._groups]

    def parameter_hash(self) -> str:
        """SHA-256 of every group's flat parameters (compare it across ranks)."""
        import hashlib

        h = hashlib.sha256()
        for g in self._groups:
            h.update(g.flat.numpy().tobytes())
        return h.hexdigest()

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """This rank's optimizer state: the param groups (hyperparameters, as torch does) and,
        per group, the library checkpoint (momentum, residual, masks, step counter,
        hyperparameters; versioned and checksummed) as a uint8 tensor. Parameters are not
        included: save the model's state_dict as usual. Each rank saves its own."""
        sd = super().state_dict()
        sd["scape"] = {
            "format": 1, "rank": self._comm.rank, "size": self._comm.size,
            "checkpoints": [g.save() for g in self._groups],
        }
        for pg in sd["param_groups"]:
            pg["payload_dtype"] = int(pg["payload_dtype"])
            pg["mask_encoding"] = int(pg["mask_encoding"])
            if pg.get("mask_ownership") is not None:
                pg["mask_ownership"] = int(pg["mask_ownership"])
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores a state saved by :meth:`state_dict` on the same rank of a run with the same
        rank count and layout. Collective (every rank loads its own). The library validates
        every rank's checkpoint and the ranks agree before anything changes: if any is bad,
        every rank raises and nothing is changed."""
        sc = state_dict.get("scape") if isinstance(state_dict, dict) else None
        if not isinstance(sc, dict) or "checkpoints" not in sc:
            raise bad_arg("state_dict", "not a ScapeAdamS state_dict (no 'scape' entry)")
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups) or len(sc["checkpoints"]) != len(self._groups):
            raise bad_arg("state_dict", f"has {len(groups)} param groups, this optimizer "
                                        f"{len(self.param_groups)}")
        for i, (saved, pg) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(pg["params"]):
                raise bad_arg("state_dict", f"param group {i} has {len(saved['params'])} "
                                            f"parameters, this optimizer {len(pg['params'])}")
        if sc.get("size") != self._comm.size or sc.get("rank") != self._comm.rank:
            # still let the library decide (it refuses on every rank together), but say why
            warnings.warn(f"state_dict was saved by rank {sc.get('rank')} of {sc.get('size')}, "
                          f"loading on rank {self._comm.rank} of {self._comm.size}")
        for saved, pg, g, blob in zip(groups, self.param_groups, self._groups,
                                      sc["checkpoints"]):
            g.load(blob, float(saved["lr"]))
        for saved, pg in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k == "params":
                    continue
                if k == "payload_dtype":
                    v = DataType(v)
                elif k == "mask_encoding":
                    v = MaskEncoding(v)
                elif k == "mask_ownership" and v is not None:
                    v = Ownership(v)
                elif k == "betas":
                    v = tuple(v)
                pg[k] = v
        for pg, g in zip(self.param_groups, self._groups):
            g.fixed = {k: pg[k] for k in self._FIXED if k in pg}
            g.lr = float(pg["lr"])

    # -- lifetime ------------------------------------------------------------------------

    def destroy(self) -> None:
        """Frees the library optimizers (before destroying the communicator). The parameters
        stay valid (they keep the flat buffers alive)."""
        for g in self._groups:
            g.destroy()

    def __del__(self) -> None:
        try:
            self.destroy()
        except Exception:
            pass

    def __setstate__(self, state: Dict[str, Any]) -> None:
        raise InvalidUsageError("a ScapeAdamS cannot be unpickled; build a new one and call "
                                "load_state_dict", function="ScapeAdamS")
