"""DeepSpeed with :class:`scape.optim.ScapeAdamS`: one call gives an engine whose only gradient
exchange is ScapeAdamS's sparse one.

Use :func:`initialize` where you would call ``deepspeed.initialize``, and start the ranks as
usual (``deepspeed train.py``, torchrun, ``python3 -m scape.launch -n N train.py``)::

    from scape.integrations.deepspeed import initialize
    engine, optimizer, _, _ = initialize(
        model=model,
        config={"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2},
        lr=3e-3, weight_decay=0.01, max_grad_norm=1.0, density=0.01)
    for batch in data:
        loss = engine(batch)                 # forward, as with any DeepSpeed engine
        engine.backward(loss)
        engine.step()                        # ScapeAdamS steps at each accumulation boundary
    engine.save_checkpoint("ckpt")           # every rank, as DeepSpeed requires
    engine.load_checkpoint("ckpt")           # resumes bit-identically on every rank

What the engine is (docs/frameworks.md, "DeepSpeed"):

- the optimizer is a ScapeAdamS built by DeepSpeed's client-optimizer callable, i.e. after the
  engine has placed the module on its device and broadcast rank 0's weights, over the
  trainable parameters (or ``model_parameters``), with the keywords given to :func:`initialize`
  (``lr``, ``betas``, ``eps``, ``weight_decay``, ``density``, ``max_grad_norm``,
  ``payload_dtype``, ``sharded``, ...). ZeRO stage 0 and no fp16/bf16/amp section, so
  ``engine.step()`` calls ``ScapeAdamS.step()`` itself, unwrapped;
- the engine's gradient all-reduce does not run: the engine's class becomes a subclass
  (``Scape<EngineClass>``) whose ``allreduce_gradients`` sends nothing (it counts the calls in
  ``engine.scape_skipped_allreduces``). ``enable_backward_allreduce`` stays True on purpose:
  DeepSpeed 0.16 divides the loss by ``gradient_accumulation_steps`` only while it is True,
  so accumulation means the same as in a dense DeepSpeed run (the mean over micro-batches),
  and ``engine.step()`` still steps once per global batch;
- ``engine.zero_grad()`` (which DeepSpeed calls after each step) zeroes ScapeAdamS's flat
  gradient buffer instead of setting every ``p.grad`` to None, so backward keeps writing into
  the buffer the library reads (no copy per step);
- checkpoints: at ZeRO 0 DeepSpeed writes the client optimizer's ``state_dict()`` into
  ``mp_rank_00_model_states.pt`` from data-parallel rank 0 only, and every rank would load
  that one. ScapeAdamS's state is per rank (error-feedback residuals, mask parts), so
  ``engine.save_checkpoint`` also writes each rank's own state to
  ``<save_dir>/<tag>/scape_adams_rank<R>_of<N>.pt`` (before DeepSpeed writes ``latest``), and
  ``engine.load_checkpoint`` loads DeepSpeed's files without their optimizer entry and each
  rank's own file (all ranks agree first that every file is there). Resuming continues
  bit-identically on every rank (tests/python/test_fw_deepspeed.py). Rank 0's state is also in
  DeepSpeed's model file (DeepSpeed puts it there; it is not read back).

What it refuses, with a ``ValueError`` naming the config key and what to do instead: any
setting that would wrap, replace or clip the optimizer, or reduce gradients itself —
``optimizer`` (a DeepSpeed-built optimizer), ``zero_optimization.stage`` > 0 (ZeRO 1-3
partition gradients and reduce them in backward; ``sharded=True`` partitions ScapeAdamS's
state as ZeRO-1 does), ZeRO offload, ``fp16`` / ``bf16`` / ``amp`` enabled (their optimizer
wrappers keep fp32 masters and step them; for 16-bit training cast the model to bfloat16 and
ScapeAdamS keeps the fp32 masters, ``master_weights``), ``gradient_clipping`` > 0 (DeepSpeed
would clip each rank's raw local gradient; pass ``max_grad_norm`` and ScapeAdamS clips the
averaged gradient with one global norm). A ``scheduler`` section, logging, timers, the data
loader and everything else stay DeepSpeed's. Settings that only shape the all-reduce that no
longer runs (``prescale_gradients``, ``gradient_predivide_factor``,
``communication_data_type``, ``sparse_gradients``) are ignored with a warning.

Needs deepspeed (0.16.4 tested here, over torch 1.13 on CPU with gloo; written against the
public engine API that 0.19 still has: ``deepspeed.initialize`` with a client-optimizer
callable, ``allreduce_gradients``, ``zero_grad``, ``save_checkpoint``/``load_checkpoint``).
DeepSpeed is imported only when :func:`initialize` runs.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, Iterable, Optional, Tuple, Union

import torch

__all__ = ["initialize", "check_config", "scape_optimizer_file", "ScapeEngineMixin"]

# config keys that only change the gradient all-reduce, which does not run
_IGNORED = ("prescale_gradients", "gradient_predivide_factor", "communication_data_type",
            "sparse_gradients")


def _enabled(section: Any) -> bool:
    if isinstance(section, dict):
        return bool(section.get("enabled", False))
    return bool(section)


def check_config(config: Dict[str, Any]) -> None:
    """Raises ``ValueError`` naming the first key of a DeepSpeed config `config` (a dict) that
    would wrap, replace or clip ScapeAdamS or reduce gradients itself, and saying what to do
    instead; warns about keys that only shape the (disabled) gradient all-reduce. See the
    module docstring for the list."""
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a dict, got {type(config).__name__}")
    if config.get("optimizer"):
        raise ValueError(
            "config['optimizer']: DeepSpeed would build its own optimizer; ScapeAdamS is the "
            "client optimizer here: remove the section and pass its hyperparameters (lr, betas, "
            "eps, weight_decay) as keywords of scape.integrations.deepspeed.initialize")
    zero = config.get("zero_optimization")
    if zero is not None:
        stage = zero.get("stage", 0) if isinstance(zero, dict) else (1 if zero else 0)
        try:
            stage = int(stage)
        except (TypeError, ValueError):
            raise ValueError(f"config['zero_optimization']['stage']: expected an int, got "
                             f"{stage!r}") from None
        if stage > 0:
            raise ValueError(
                f"config['zero_optimization']['stage'] = {stage}: ZeRO stages 1-3 wrap the "
                f"optimizer and reduce (partition) gradients themselves; use stage 0. "
                f"ScapeAdamS(sharded=True) (pass sharded=True to initialize) partitions the "
                f"optimizer state over the ranks as ZeRO-1 does")
        if isinstance(zero, dict):
            for k in ("offload_optimizer", "offload_param"):
                off = zero.get(k)
                dev = off.get("device", "none") if isinstance(off, dict) else off
                if off and str(dev).lower() not in ("none", ""):
                    raise ValueError(
                        f"config['zero_optimization']['{k}']: ZeRO offload replaces the "
                        f"optimizer with DeepSpeed's CPU optimizer; remove it (ScapeAdamS "
                        f"steps where the parameters are)")
    for k in ("fp16", "bf16", "bfloat16"):
        if _enabled(config.get(k)):
            raise ValueError(
                f"config['{k}']['enabled']: DeepSpeed's {k} optimizer wraps the client "
                f"optimizer (its own fp32 masters, loss scaling, gradient handling); remove the "
                f"section. For 16-bit training cast the model (model.to(torch.bfloat16)) before "
                f"initialize: ScapeAdamS keeps fp32 master weights of 16-bit parameters "
                f"(master_weights=None, the default) and writes the rounded 16-bit values")
    if _enabled(config.get("amp")):
        raise ValueError(
            "config['amp']['enabled']: apex AMP wraps the optimizer; remove the section (for "
            "16-bit training cast the model to bfloat16: ScapeAdamS keeps fp32 masters)")
    clip = config.get("gradient_clipping", 0.0)
    try:
        clip_f = float(clip or 0.0)
    except (TypeError, ValueError):
        raise ValueError(f"config['gradient_clipping']: expected a number, got {clip!r}") from None
    if clip_f > 0.0:
        raise ValueError(
            f"config['gradient_clipping'] = {clip!r}: DeepSpeed would clip each rank's raw local "
            f"gradient before ScapeAdamS's exchange; remove it and pass max_grad_norm={clip!r} "
            f"to initialize: ScapeAdamS clips the averaged (recovered) gradient with one global "
            f"norm over every rank")
    for k in _IGNORED:
        if config.get(k):
            warnings.warn(f"scape.integrations.deepspeed: config['{k}'] only changes DeepSpeed's "
                          f"gradient all-reduce, which does not run (ScapeAdamS exchanges the "
                          f"gradients): ignored", stacklevel=3)


def _load_config(config: Any) -> Dict[str, Any]:
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config: no DeepSpeed config file at {path!r}")
        with open(path) as f:
            text = f.read()
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            import hjson  # deepspeed's own dependency: DeepSpeed config files may be hjson

            return dict(hjson.loads(text))
    raise TypeError(f"config: expected a dict or the path of a DeepSpeed JSON config, got "
                    f"{type(config).__name__}")


def scape_optimizer_file(checkpoint_dir: str, rank: int, size: int) -> str:
    """The path of rank `rank`'s ScapeAdamS state (of `size` ranks) inside one DeepSpeed
    checkpoint folder (``<save_dir>/<tag>``)."""
    return os.path.join(checkpoint_dir, f"scape_adams_rank{rank}_of{size}.pt")


class ScapeEngineMixin:
    """Mixed in front of the engine's class by :func:`initialize` (the engine's class becomes
    ``Scape<EngineClass>``): no gradient all-reduce, zero_grad into the flat buffer, and
    per-rank ScapeAdamS state in checkpoints. ``engine.scape_optimizer`` is the ScapeAdamS,
    ``engine.scape_comm`` its communicator."""

    scape_optimizer: Any
    scape_comm: Any
    scape_skipped_allreduces: int
    _scape_owns_comm: bool

    def allreduce_gradients(self, *args: Any, **kwargs: Any) -> None:
        """Sends nothing: each rank keeps its own (accumulated) gradients, which ScapeAdamS
        exchanges sparsely in its step. Counts the calls in ``scape_skipped_allreduces``."""
        self.scape_skipped_allreduces += 1

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """Zeroes ScapeAdamS's flat gradient buffers (``p.grad`` stay views into them)."""
        self.scape_optimizer.zero_grad(set_to_none=False)

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: Any = None,
                        save_latest: bool = True, **kwargs: Any) -> Any:
        """DeepSpeed's ``save_checkpoint`` (every rank calls it) plus this rank's ScapeAdamS
        state in ``<save_dir>/<tag>/scape_adams_rank<R>_of<N>.pt``, written before DeepSpeed's
        own files and its ``latest``. `tag` defaults to DeepSpeed's ``global_step<N>``."""
        if tag is None:
            tag = f"global_step{self.global_steps}"
        tag = str(tag)
        opt, comm = self.scape_optimizer, self.scape_comm
        ckpt_dir = os.path.join(save_dir, tag)
        os.makedirs(ckpt_dir, exist_ok=True)
        path = scape_optimizer_file(ckpt_dir, comm.rank, comm.size)
        blob = {"format": 1, "rank": comm.rank, "size": comm.size,
                "global_steps": int(self.global_steps), "optimizer": opt.state_dict()}
        tmp = path + ".tmp"
        torch.save(blob, tmp)
        os.replace(tmp, path)
        return super().save_checkpoint(save_dir, tag=tag,  # type: ignore[misc]
                                       client_state={} if client_state is None else client_state,
                                       save_latest=save_latest, **kwargs)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        **kwargs: Any) -> Tuple[Optional[str], Any]:
        """DeepSpeed's ``load_checkpoint`` without its (rank 0) optimizer entry, then each
        rank's own ScapeAdamS state from the same checkpoint folder (collective). Raises
        ``FileNotFoundError`` on every rank when some rank's file is missing (a checkpoint not
        saved through this engine, or saved with another rank count). Returns what DeepSpeed
        returns: ``(load_path, client_state)``, ``(None, None)`` when there is no checkpoint."""
        load_path, client_state = super().load_checkpoint(  # type: ignore[misc]
            load_dir, tag=tag, load_module_strict=load_module_strict,
            load_optimizer_states=False, load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only, **kwargs)
        if load_path is None or not load_optimizer_states or load_module_only:
            return load_path, client_state
        opt, comm = self.scape_optimizer, self.scape_comm
        path = scape_optimizer_file(os.path.dirname(load_path), comm.rank, comm.size)
        have = torch.zeros(comm.size, dtype=torch.float32)
        comm.all_gather(torch.tensor([1.0 if os.path.isfile(path) else 0.0]), have)
        missing = [r for r in range(comm.size) if float(have[r]) != 1.0]
        if missing:
            raise FileNotFoundError(
                f"load_checkpoint: {os.path.dirname(path)} lacks the ScapeAdamS state of rank"
                f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of "
                f"{comm.size} ({os.path.basename(scape_optimizer_file('', missing[0], comm.size))}"
                f"): it was not saved by an engine of scape.integrations.deepspeed.initialize "
                f"with {comm.size} ranks; pass load_optimizer_states=False to load the model "
                f"(and scheduler) only")
        blob = torch.load(path, map_location="cpu")
        opt.load_state_dict(blob["optimizer"])
        return load_path, client_state

    def scape_destroy(self) -> None:
        """Frees ScapeAdamS's library optimizers and, when :func:`initialize` made it, the
        communicator (call at the end, on every rank)."""
        self.scape_optimizer.destroy()
        if self._scape_owns_comm:
            self.scape_comm.destroy()


def _mix_in(engine: Any) -> None:
    cls = type(engine)
    if issubclass(cls, ScapeEngineMixin):
        return
    engine.__class__ = type(f"Scape{cls.__name__}", (ScapeEngineMixin, cls),
                            {"__module__": __name__})


def initialize(model: torch.nn.Module, config: Union[Dict[str, Any], str, os.PathLike],
               *, comm: Any = None, model_parameters: Optional[Iterable[Any]] = None,
               training_data: Any = None, lr_scheduler: Any = None, collate_fn: Any = None,
               mpu: Any = None, args: Any = None, dist_init_required: Optional[bool] = None,
               **scape_kwargs: Any) -> Tuple[Any, ...]:
    """``deepspeed.initialize`` with ScapeAdamS as the client optimizer and the engine's
    gradient exchange replaced by ScapeAdamS's (see the module docstring).

    Args:
        model: the ``torch.nn.Module`` to train (fp32, or bf16/fp16 for ScapeAdamS's masters).
        config: the DeepSpeed config: a dict or the path of a JSON (hjson) file. Checked by
            :func:`check_config` first (a ``ValueError`` names a refused key).
        comm: the :class:`scape.Communicator` of the data-parallel ranks. Default: one made
            from the engine's data-parallel process group
            (:meth:`scape.Communicator.from_process_group`: ``mpu.get_data_parallel_group()``
            with an `mpu`, else every rank; ``backend="nccl"`` when the engine has put the
            parameters on a CUDA device, else ``"ucx"``), timeout from SCAPE_TIMEOUT_MS if
            set; it is then the engine's (``engine.scape_destroy()`` frees it).
        model_parameters: parameters or parameter groups for ScapeAdamS (default: the model's
            parameters that require gradients, one group). Empty groups are dropped.
        training_data, lr_scheduler, collate_fn, mpu, args, dist_init_required: passed to
            ``deepspeed.initialize`` (which creates torch's process group from the launcher's
            environment if there is none: NCCL on GPUs, gloo on CPU).
        **scape_kwargs: keywords of :class:`scape.optim.ScapeAdamS` (``lr``, ``betas``,
            ``eps``, ``weight_decay``, ``density``, ``warmup_steps``, ``max_grad_norm``,
            ``payload_dtype``, ``sharded``, ``master_weights``, ...).

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)`` as ``deepspeed.initialize``:
        `optimizer` is the ScapeAdamS (``engine.optimizer`` too).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if "comm" in scape_kwargs or "params" in scape_kwargs:
        raise TypeError("initialize: give comm as comm=... and the parameters as "
                        "model_parameters=..., not inside the ScapeAdamS keywords")
    cfg = _load_config(config)
    check_config(cfg)
    import deepspeed

    from ..comm import Communicator
    from ..optim import ScapeAdamS

    made: Dict[str, Any] = {}

    def build_optimizer(params: Iterable[Any]) -> ScapeAdamS:
        groups = list(params)
        if groups and isinstance(groups[0], dict):
            groups = [dict(g, params=list(g["params"])) for g in groups]
            groups = [g for g in groups if g["params"]]  # DeepSpeed drops empty groups too
        if not groups:
            raise ValueError("model_parameters: no parameters to train (none requires grad)")
        c = comm
        if c is None:
            timeout = os.environ.get("SCAPE_TIMEOUT_MS")
            pg = mpu.get_data_parallel_group() if mpu is not None else None
            first = groups[0]["params"][0] if isinstance(groups[0], dict) else groups[0]
            backend = "nccl" if first.device.type == "cuda" else "ucx"
            c = Communicator.from_process_group(pg, backend=backend,
                                                timeout_ms=int(timeout) if timeout else None)
            made["owned"] = True
        made["comm"] = c
        opt = ScapeAdamS(groups, c, **scape_kwargs)
        made["opt"] = opt
        return opt

    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    engine, optimizer, loader, sched = deepspeed.initialize(
        args=args, model=model, optimizer=build_optimizer, model_parameters=model_parameters,
        training_data=training_data, lr_scheduler=lr_scheduler, collate_fn=collate_fn, mpu=mpu,
        dist_init_required=dist_init_required, config=cfg)
    opt = made.get("opt")
    if opt is None or engine.optimizer is not opt:
        raise RuntimeError(f"deepspeed.initialize did not use ScapeAdamS as the engine's "
                           f"optimizer unwrapped (got {type(engine.optimizer).__name__}); "
                           f"check the config for a section that wraps the optimizer")
    if len(opt.param_groups) != len(opt.flat_parameters()):
        raise RuntimeError("deepspeed.initialize changed ScapeAdamS's parameter groups")
    _mix_in(engine)
    engine.scape_optimizer = opt
    engine.scape_comm = made["comm"]
    engine.scape_skipped_allreduces = 0
    engine._scape_owns_comm = bool(made.get("owned"))
    return engine, opt, loader, sched
