"""megatron-core with ScapeAdamS: the optimizer built from Megatron's own parameter groups, the
communicator over Megatron's data-parallel group, and per-rank optimizer checkpoints beside
Megatron's. See docs/frameworks.md, "megatron-core"; the worked example is
examples/megatron_core_scape.py.

:class:`scape.optim.ScapeAdamS` owns the data-parallel exchange (it averages the new first
moment at an agreed mask, values only), so on the data-parallel axis it replaces two pieces of
Megatron at once:

- the optimizer (``get_megatron_optimizer``: ``FP32Optimizer``,
  ``Float16OptimizerWithFloat16Params`` or ``DistributedOptimizer`` around Adam), and
- the gradient all-reduce (``megatron.core.distributed.DistributedDataParallel`` and its
  ``finish_grad_sync``, which ``finalize_model_grads`` calls).

The model is therefore **not** wrapped in Megatron's ``DistributedDataParallel`` and
``finalize_model_grads`` is **not** called (``config.finalize_model_grads_func`` stays None, so
megatron-core's schedules, ``get_forward_backward_func()``, do not call it either): backward
leaves each rank's own gradients in ScapeAdamS's flat buffer (``p.grad`` are views into it;
micro-batches accumulate there), and ``opt.step()`` exchanges and updates.
:func:`scape_optimizer` refuses a model chunk that is wrapped in Megatron's (or torch's)
``DistributedDataParallel``: such a wrapper would all-reduce every gradient densely in its
backward hooks and keep them in its own ``main_grad`` buffer, which ScapeAdamS never reads.

The calls, after ``torch.distributed.init_process_group`` and
``parallel_state.initialize_model_parallel(...)``::

    from megatron.core.optimizer import OptimizerConfig
    from scape.integrations.megatron import scape_optimizer, save_optimizer, load_optimizer

    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=..., max_sequence_length=...)
    opt = scape_optimizer([model], OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=1.0),
                          density=0.1)          # any other ScapeAdamS keyword, e.g. warmup_steps
    forward_backward = get_forward_backward_func()
    for it in range(steps):                     # each rank reads its own shard
        opt.zero_grad()
        forward_backward(forward_step_func=forward_step, data_iterator=microbatches,
                         model=[model], num_microbatches=n, seq_length=s,
                         micro_batch_size=b, forward_only=False)
        opt.step()                              # no finalize_model_grads
    save_optimizer(opt, "ckpt", iteration)      # every DP rank, beside Megatron's files
    load_optimizer(opt, "ckpt", iteration)      # every rank (collective)

What it needs: megatron-core (imported lazily, inside the functions; 0.8.0 is what is run
here, on torch 1.13 CPU with gloo), and torch.distributed initialised with Megatron's
model-parallel groups (``parallel_state.initialize_model_parallel``). It uses only
``parallel_state``'s group and rank getters, ``OptimizerConfig``'s fields and the
``DistributedDataParallel`` class name, which current megatron-core (for torch 2.x) still has
(read in its source, not run here); nothing in it is specific to 0.8.0 or to the CPU.

What it refuses, and why (each with an error naming the argument):

- a model chunk wrapped in ``DistributedDataParallel`` (above), megatron-core's or torch's
  FSDP, or whose ``config.finalize_model_grads_func`` / ``config.grad_sync_func`` is set (the
  schedules would call them after backward);
- ``config.optimizer != "adam"``: ScapeAdamS is AdamS (Adam without a second-moment state);
  Megatron's "sgd" has no counterpart; nor has L2 weight decay (newer releases'
  ``decoupled_weight_decay=False``): ScapeAdamS's is decoupled, as Megatron's default AdamW;
- ``config.fp16``: Megatron's loss scaler lives in the ``Float16OptimizerWithFloat16Params``
  wrapper this replaces. Use bf16 parameters (``config.bf16`` is accepted: ScapeAdamS keeps the
  fp32 master weights itself) or an fp16 model with ``torch.cuda.amp.GradScaler``, without
  ``config.fp16``;
- ``config.use_distributed_optimizer``: Megatron's distributed optimizer shards the optimizer
  state to save memory. ``ScapeAdamS(sharded=True)`` shards the update work and exchanges the
  updated values at the mask only, but every rank still holds momentum and residual of every
  parameter, so it is not a memory-saving replacement; pass ``sharded=True`` yourself if that
  is what you want;
- parameters Megatron marks as expert-parallel (``param.allreduce == False``, MoE with expert
  parallelism): they are averaged over another data-parallel group, which needs a second
  communicator; not supported;
- ``config.gradient_accumulation_fusion`` (Megatron-LM's default where the fused kernel is
  built) without ``grad_dtype=torch.float32``: the fused linear layers write weight gradients
  into ``param.main_grad``, which only Megatron's DDP allocates; ScapeAdamS with
  ``grad_dtype=torch.float32`` (16-bit parameters) provides ``p.main_grad`` as fp32 views of its
  flat gradient, which is what the fused kernel expects (not run here: it needs CUDA);
- the other reductions ``finalize_model_grads`` does besides the data-parallel one: with
  tensor parallelism and sequence parallelism (layer-norm gradients all-reduced over the
  tensor-parallel group) or with pipeline parallelism and shared input/output embeddings
  (embedding gradients all-reduced between the first and last stage). Both are refused,
  because skipping ``finalize_model_grads`` would silently skip them.

Parameter groups: :func:`param_groups` applies megatron-core's rule (``get_megatron_optimizer``
via the private ``_get_param_groups`` in ``megatron/core/optimizer/__init__.py``): no weight
decay for biases and 1-D parameters (norms), an ``lr_mult`` for parameters matching
``scale_lr_cond``. It mirrors that rule rather than calling the private function, whose
signature changes between megatron-core releases. Each group carries Megatron's keys
(``wd_mult``, ``lr_mult``, ``max_lr``, ``min_lr``, ``is_expert_parallel``,
``is_decoupled_lr``), and its ``lr`` and ``weight_decay`` start at the configured values times
the multipliers, so it is right without a scheduler; Megatron-LM's ``OptimizerParamScheduler``
keeps writing ``group["lr"]`` and ``group["weight_decay"]`` from those keys, and ScapeAdamS
reads both at every step. Norms and biases are also ScapeAdamS's always-dense tensors (1-D).

Checkpoints: :func:`save_optimizer` writes this data-parallel rank's ScapeAdamS state to
``<dir>/iter_<iteration:07d>/<mp_rank dir>/scape_optim_dp_rank_<dp:03d>.pt``, where
``<mp_rank dir>`` is Megatron-LM's legacy checkpoint directory of this model-parallel rank
(``mp_rank_<tp:02d>``, ``mp_rank_<tp:02d>_<pp:03d>`` with pipeline parallelism), the folder of
its ``model_optim_rng.pt`` and ``distrib_optim.pt``. The error-feedback residuals differ per
rank, so every data-parallel rank saves and loads its own file. Megatron's own
``save_checkpoint`` keeps saving the model (pass it no optimizer, or ``--no-save-optim``).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional

import torch

__all__ = ["param_groups", "data_parallel_communicator", "scape_optimizer", "check_model",
           "optimizer_checkpoint_path", "save_optimizer", "load_optimizer"]


def _parallel_state():
    try:
        from megatron.core import parallel_state
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("scape.integrations.megatron needs megatron-core "
                          "(pip install megatron-core)") from e
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("scape.integrations.megatron: megatron-core's model-parallel groups "
                           "are not initialised: call torch.distributed.init_process_group(...) "
                           "and megatron.core.parallel_state.initialize_model_parallel(...) "
                           "first")
    return parallel_state


def _chunks(model_chunks: Any) -> List[torch.nn.Module]:
    if isinstance(model_chunks, torch.nn.Module):
        return [model_chunks]
    try:
        chunks = list(model_chunks)
    except TypeError:
        raise TypeError(f"model_chunks: expected a torch.nn.Module or a list of them (Megatron's "
                        f"model chunks), got {type(model_chunks).__name__}") from None
    if not chunks:
        raise ValueError("model_chunks: empty (expected Megatron's model chunks)")
    for i, m in enumerate(chunks):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"model_chunks[{i}]: expected a torch.nn.Module, got "
                            f"{type(m).__name__}")
    return chunks


def check_model(model_chunks: Any) -> List[torch.nn.Module]:
    """Checks that `model_chunks` (a module or Megatron's list of model chunks) can train with
    ScapeAdamS and returns them as a list. Refuses (``ValueError`` naming ``model_chunks``) a
    chunk wrapped in megatron-core's ``DistributedDataParallel`` (or its FSDP wrappers) or
    torch's DistributedDataParallel / FullyShardedDataParallel: such a wrapper
    all-reduces every gradient in its backward hooks (the exchange ScapeAdamS replaces) and,
    Megatron's, moves the gradients into its own ``main_grad`` buffer, which ScapeAdamS does not
    read. Pass the bare model (``GPTModel``, or ``Float16Module(GPTModel)``) and do not call
    ``finalize_model_grads``. Also refuses a chunk whose ``config.finalize_model_grads_func`` or
    ``config.grad_sync_func`` is set: megatron-core's schedules (``get_forward_backward_func``)
    would call them after backward."""
    chunks = _chunks(model_chunks)
    for i, m in enumerate(chunks):
        # megatron-core's DistributedDataParallel and, in newer releases, its FSDP wrappers
        # (TorchFullyShardedDataParallel, MegatronFSDP; their base _BaseDataParallel), found
        # by name so that every release is covered without importing each
        megatron_dp = [type(m).__name__ for c in type(m).__mro__
                       if c.__module__.startswith("megatron.")
                       and (c.__name__.endswith("DataParallel") or c.__name__ == "MegatronFSDP")]
        # torch's FSDP by name: importing torch.distributed.fsdp fails on some torch 1.x
        # builds (Python 3.11), and a model wrapped in it has imported it already
        torch_fsdp = any(c.__module__.startswith("torch.distributed.fsdp")
                         and c.__name__ == "FullyShardedDataParallel" for c in type(m).__mro__)
        if (megatron_dp or torch_fsdp
                or isinstance(m, torch.nn.parallel.DistributedDataParallel)):
            which = (f"megatron-core's {megatron_dp[0]}" if megatron_dp else
                     f"torch's {type(m).__name__}")
            raise ValueError(
                f"model_chunks[{i}] is wrapped in {which}: ScapeAdamS does the data-parallel "
                f"exchange itself, and the wrapper would reduce every gradient densely in "
                f"backward{' into its own main_grad buffer' if megatron_dp else ''}. Pass the "
                f"unwrapped model (e.g. `model.module`) and do not call finalize_model_grads")
        cfg = getattr(m, "config", None)
        for k in ("finalize_model_grads_func", "grad_sync_func"):
            if cfg is not None and getattr(cfg, k, None) is not None:
                raise ValueError(
                    f"model_chunks[{i}].config.{k} is set: megatron-core's schedules "
                    f"(get_forward_backward_func) call it after backward to reduce the "
                    f"gradients over the data-parallel group, which ScapeAdamS does itself; "
                    f"set config.{k} = None (Megatron-LM's training loop sets it in train())")
    return chunks


def _check_other_reductions(chunks: List[torch.nn.Module], ps: Any) -> None:
    """Refuses the setups in which finalize_model_grads does more than the data-parallel
    all-reduce (skipping it would skip those reductions too)."""
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    for i, m in enumerate(chunks):
        cfg = getattr(m, "config", None)
        if tp > 1 and cfg is not None and getattr(cfg, "sequence_parallel", False):
            raise ValueError(
                f"model_chunks[{i}]: sequence_parallel with tensor parallelism ({tp}) needs the "
                f"layer-norm gradients all-reduced over the tensor-parallel group, which "
                f"finalize_model_grads does and ScapeAdamS does not; not supported")
        inner = m
        while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
            inner = inner.module  # Float16Module
        if pp > 1 and getattr(inner, "share_embeddings_and_output_weights", False):
            raise ValueError(
                f"model_chunks[{i}]: shared input/output embeddings with pipeline parallelism "
                f"({pp} stages) need their gradients all-reduced between the first and last "
                f"stage, which finalize_model_grads does and ScapeAdamS does not; build the "
                f"model with share_embeddings_and_output_weights=False")


def param_groups(model_chunks: Any, *, lr: float, weight_decay: float,
                 no_weight_decay_cond: Optional[Callable[[str, torch.Tensor], bool]] = None,
                 scale_lr_cond: Optional[Callable[[str, torch.Tensor], bool]] = None,
                 lr_mult: float = 1.0, min_lr: float = 0.0) -> List[Dict[str, Any]]:
    """megatron-core's parameter groups for `model_chunks`, by the rule of
    ``get_megatron_optimizer`` (mirrored from megatron-core's private ``_get_param_groups``):

    - parameters with ``requires_grad=False`` are left out;
    - no weight decay (``wd_mult=0``) for names ending in ``.bias`` and for 1-D parameters
      (norms), or where ``no_weight_decay_cond(name, param)`` is true when it is given;
    - ``lr_mult`` for parameters where ``scale_lr_cond(name, param)`` is true (fine-tuning a
      head), 1.0 otherwise;
    - one group per distinct (wd_mult, lr_mult), in first-seen order, split further by dtype
      and device where those differ (ScapeAdamS keeps one flat buffer per group; e.g. fp32
      parameters that a bf16 model keeps in fp32): the same parameters and multipliers as
      megatron-core's groups.

    Each group holds Megatron's keys ``wd_mult``, ``lr_mult``, ``max_lr`` (= `lr`), ``min_lr``,
    ``is_expert_parallel`` (False) and ``is_decoupled_lr`` (False; Megatron's ``decoupled_lr``
    for the embedding and output layer is not supported), and ``lr = lr * lr_mult`` and
    ``weight_decay = weight_decay * wd_mult``, which Megatron-LM's ``OptimizerParamScheduler``
    rewrites at every step. Refuses expert-parallel parameters (``param.allreduce`` False)."""
    chunks = _chunks(model_chunks)
    if not lr >= 0.0:
        raise ValueError(f"lr: must be >= 0, got {lr!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay: must be >= 0, got {weight_decay!r}")
    if not lr_mult > 0.0:
        raise ValueError(f"lr_mult: must be > 0, got {lr_mult!r}")
    by_key: Dict[tuple, List[torch.Tensor]] = {}
    seen = set()
    for ci, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if not getattr(p, "allreduce", True):
                raise ValueError(
                    f"model_chunks[{ci}]: parameter {name!r} is expert-parallel "
                    f"(param.allreduce is False): it is averaged over the expert data-parallel "
                    f"group, which needs a second communicator; not supported")
            if no_weight_decay_cond is not None:
                no_wd = bool(no_weight_decay_cond(name, p))
            else:
                no_wd = name.endswith(".bias") or len(p.shape) == 1
            scale = bool(scale_lr_cond(name, p)) if scale_lr_cond is not None else False
            # ScapeAdamS flattens each group into one buffer: one dtype and device per group
            key = (0.0 if no_wd else 1.0, lr_mult if scale else 1.0, p.dtype, str(p.device))
            by_key.setdefault(key, []).append(p)
    if not by_key:
        raise ValueError("model_chunks: no parameter requires a gradient")
    return [{"params": ps, "wd_mult": wd_mult, "lr_mult": lm, "is_expert_parallel": False,
             "is_decoupled_lr": False, "max_lr": lr, "min_lr": min_lr,
             "lr": lr * lm, "weight_decay": weight_decay * wd_mult}
            for (wd_mult, lm, _, _), ps in by_key.items()]


def data_parallel_communicator(**kwargs: Any) -> Any:
    """The :class:`scape.Communicator` of this rank's megatron-core data-parallel group
    (``parallel_state.get_data_parallel_group(with_context_parallel=True)``: with context
    parallelism Megatron averages gradients over data- and context-parallel ranks together),
    made with :meth:`scape.Communicator.from_process_group` (collective over that group).
    Keywords go to it (``backend="nccl"`` on GPUs, ``timeout_ms``, ...); ``timeout_ms`` defaults
    to the ``SCAPE_TIMEOUT_MS`` environment variable when set."""
    from ..comm import Communicator

    ps = _parallel_state()
    try:
        group = ps.get_data_parallel_group(with_context_parallel=True)
    except TypeError:  # a megatron-core without context parallelism
        group = ps.get_data_parallel_group()
    if "timeout_ms" not in kwargs and os.environ.get("SCAPE_TIMEOUT_MS"):
        kwargs["timeout_ms"] = int(os.environ["SCAPE_TIMEOUT_MS"])
    return Communicator.from_process_group(group, **kwargs)


def scape_optimizer(model_chunks: Any, config: Any = None, *, comm: Any = None,
                    no_weight_decay_cond: Optional[Callable[[str, torch.Tensor], bool]] = None,
                    scale_lr_cond: Optional[Callable[[str, torch.Tensor], bool]] = None,
                    lr_mult: float = 1.0, **scape_kwargs: Any) -> Any:
    """ScapeAdamS over megatron-core's parameter groups, the drop-in for
    ``get_megatron_optimizer(config, model_chunks, no_weight_decay_cond, scale_lr_cond,
    lr_mult)``.

    Args:
        model_chunks: the model (a module) or Megatron's list of model chunks, **not** wrapped
            in ``DistributedDataParallel`` (see :func:`check_model`).
        config: a ``megatron.core.optimizer.OptimizerConfig`` (or None: its defaults). Read:
            ``lr``, ``min_lr``, ``weight_decay``, ``adam_beta1``, ``adam_beta2``, ``adam_eps``,
            ``clip_grad`` (ScapeAdamS's ``max_grad_norm``: the averaged gradient's global norm,
            as Megatron clips) and, where the release has it, ``apply_wd_to_qk_layernorm``.
            Newer releases' per-parameter overrides of ``get_megatron_optimizer`` are not read:
            pass ``no_weight_decay_cond`` / ``scale_lr_cond``. Refused: ``optimizer`` other
            than "adam", ``fp16``, ``use_distributed_optimizer``, ``decoupled_lr``,
            ``decoupled_weight_decay=False`` (module docstring). ``bf16`` is fine: give
            ScapeAdamS the bf16 parameters, it keeps fp32 masters.
        comm: a :class:`scape.Communicator` over the data-parallel ranks (default:
            :func:`data_parallel_communicator`). Its size must be the data-parallel size.
        no_weight_decay_cond, scale_lr_cond, lr_mult: as for ``get_megatron_optimizer``
            (:func:`param_groups`).
        **scape_kwargs: any other :class:`scape.optim.ScapeAdamS` keyword (``density``,
            ``warmup_steps``, ``payload_dtype``, ``sharded``, ...); ``lr``, ``betas``, ``eps``,
            ``weight_decay`` and ``max_grad_norm`` come from `config` and are refused here.

    Returns the :class:`scape.optim.ScapeAdamS` (its construction is collective over `comm`:
    rank 0's parameters are broadcast so every rank starts identical). Call ``opt.zero_grad()``,
    backward, ``opt.step()``; do not call ``finalize_model_grads``.
    """
    from ..optim import ScapeAdamS

    chunks = check_model(model_chunks)
    ps = _parallel_state()
    _check_other_reductions(chunks, ps)
    for i, m in enumerate(chunks):
        cfg = getattr(m, "config", None)
        if (getattr(cfg, "gradient_accumulation_fusion", False)
                and scape_kwargs.get("grad_dtype") is not torch.float32):
            raise ValueError(
                f"model_chunks[{i}].config.gradient_accumulation_fusion: the fused linear layers "
                f"write weight gradients into param.main_grad, which Megatron's DDP allocates. "
                f"Set it False (Megatron-LM: --no-gradient-accumulation-fusion), or, with 16-bit "
                f"parameters, pass grad_dtype=torch.float32: ScapeAdamS then makes p.main_grad "
                f"fp32 views of its flat gradient (not run here: the fused kernel needs CUDA)")
    if config is None:
        from megatron.core.optimizer import OptimizerConfig

        config = OptimizerConfig()
    opt_name = getattr(config, "optimizer", "adam")
    if opt_name != "adam":
        raise ValueError(f"config.optimizer: ScapeAdamS replaces Megatron's 'adam', got "
                         f"{opt_name!r}")
    if getattr(config, "fp16", False):
        raise ValueError("config.fp16: Megatron's fp16 loss scaler lives in the optimizer "
                         "wrapper ScapeAdamS replaces; use bf16 parameters (config.bf16), or an "
                         "fp16 model with torch.cuda.amp.GradScaler and config.fp16=False")
    if getattr(config, "use_distributed_optimizer", False):
        raise ValueError("config.use_distributed_optimizer: Megatron's distributed optimizer "
                         "shards optimizer memory; ScapeAdamS(sharded=True) shards only the "
                         "update work (every rank keeps momentum and residual of every "
                         "parameter). Set use_distributed_optimizer=False, and pass "
                         "sharded=True here if you want the ZeRO-1 style update")
    if getattr(config, "decoupled_weight_decay", True) is False:
        raise ValueError("config.decoupled_weight_decay=False: Megatron's L2 (Adam, not AdamW) "
                         "weight decay; ScapeAdamS's weight decay is decoupled only")
    if getattr(config, "decoupled_lr", None) is not None:
        raise ValueError("config.decoupled_lr: a separate learning rate for the embedding and "
                         "output layer is not supported; use scale_lr_cond / lr_mult")
    for k in ("lr", "betas", "eps", "weight_decay", "max_grad_norm", "params"):
        if k in scape_kwargs:
            raise ValueError(f"{k}: comes from config (OptimizerConfig: lr, adam_beta1/2, "
                             f"adam_eps, weight_decay, clip_grad), not a keyword here")
    if no_weight_decay_cond is None and getattr(config, "apply_wd_to_qk_layernorm", False):
        # newer megatron-core's option: the classic rule, except that q/k layer norms decay
        def no_weight_decay_cond(name: str, p: torch.Tensor) -> bool:
            return ((len(p.shape) == 1 or name.endswith(".bias"))
                    and not ("q_layernorm." in name or "k_layernorm." in name))
    lr = float(config.lr) if config.lr is not None else 1e-3
    min_lr = float(config.min_lr) if getattr(config, "min_lr", None) is not None else 0.0
    groups = param_groups(chunks, lr=lr, weight_decay=float(config.weight_decay),
                          no_weight_decay_cond=no_weight_decay_cond,
                          scale_lr_cond=scale_lr_cond, lr_mult=lr_mult, min_lr=min_lr)
    if comm is None:
        comm = data_parallel_communicator()
    try:
        dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    except TypeError:
        dp = ps.get_data_parallel_world_size()
    if comm.size != dp:
        raise ValueError(f"comm: has {comm.size} ranks, megatron-core's data-parallel group "
                         f"{dp}: ScapeAdamS exchanges over the data-parallel ranks only "
                         f"(data_parallel_communicator() makes that communicator)")
    clip = float(getattr(config, "clip_grad", 0.0) or 0.0)
    return ScapeAdamS(groups, comm, lr=lr,
                      betas=(float(config.adam_beta1), float(config.adam_beta2)),
                      eps=float(config.adam_eps), weight_decay=float(config.weight_decay),
                      max_grad_norm=clip, **scape_kwargs)


def _ranks() -> tuple:
    ps = _parallel_state()
    try:
        dp = ps.get_data_parallel_rank(with_context_parallel=True)
        dps = ps.get_data_parallel_world_size(with_context_parallel=True)
    except TypeError:
        dp, dps = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_pipeline_model_parallel_world_size(), dp, dps)


def optimizer_checkpoint_path(directory: str, iteration: int) -> str:
    """Where :func:`save_optimizer` puts this rank's file:
    ``<directory>/iter_<iteration:07d>/mp_rank_<tp:02d>[_<pp:03d>]/scape_optim_dp_rank_<dp:03d>.pt``
    (the ``_<pp:03d>`` part only with pipeline parallelism), the folder in which Megatron-LM's
    legacy checkpoints put this model-parallel rank's ``model_optim_rng.pt``."""
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration: expected an int >= 0, got {iteration!r}")
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise ValueError(f"directory: expected a path, got {directory!r}")
    tp, pp, pps, dp, _ = _ranks()
    mp = f"mp_rank_{tp:02d}" if pps == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    return os.path.join(str(directory), f"iter_{iteration:07d}", mp,
                        f"scape_optim_dp_rank_{dp:03d}.pt")


def save_optimizer(optimizer: Any, directory: str, iteration: int,
                   extra: Optional[Dict[str, Any]] = None) -> str:
    """Saves this rank's ScapeAdamS state (``optimizer.state_dict()``: momentum, residual, masks,
    step counter, masters; local, no communication) to :func:`optimizer_checkpoint_path`,
    written to a temporary name and renamed, so a crash leaves no half file. `extra` (e.g. a
    scheduler's state_dict) is saved beside it under ``"extra"``. Call it on every
    data-parallel rank: the error-feedback residuals differ per rank. Returns the path."""
    from ..optim import ScapeAdamS

    if not isinstance(optimizer, ScapeAdamS):
        raise TypeError(f"optimizer: expected a scape.optim.ScapeAdamS, got "
                        f"{type(optimizer).__name__}")
    path = optimizer_checkpoint_path(directory, iteration)
    tp, pp, _, dp, dps = _ranks()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    blob = {"optimizer": optimizer.state_dict(), "iteration": iteration,
            "data_parallel_rank": dp, "data_parallel_size": dps, "extra": extra}
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(blob, tmp)
    os.replace(tmp, path)
    return path


def load_optimizer(optimizer: Any, directory: str, iteration: int) -> Optional[Dict[str, Any]]:
    """Restores this rank's ScapeAdamS state saved by :func:`save_optimizer` at `iteration`.
    Collective over the optimizer's communicator: every data-parallel rank calls it. The ranks
    first agree (one small all-reduce) that each found a readable file of its own: a missing
    file (``FileNotFoundError``), an unreadable one, or one saved by another rank or with
    another data-parallel size (``ValueError``; re-sharding is not supported) makes **every**
    rank raise, naming the path on the rank that has the problem, and nothing is loaded
    anywhere. Then ScapeAdamS's own load validates every rank's state the same way. Returns the
    ``extra`` saved with it."""
    from ..optim import ScapeAdamS

    if not isinstance(optimizer, ScapeAdamS):
        raise TypeError(f"optimizer: expected a scape.optim.ScapeAdamS, got "
                        f"{type(optimizer).__name__}")
    path = optimizer_checkpoint_path(directory, iteration)
    _, _, _, dp, dps = _ranks()
    blob, problem = None, None
    if not os.path.isfile(path):
        problem = (f"no ScapeAdamS state for data-parallel rank {dp} at {path} (saved by "
                   f"save_optimizer at iteration {iteration} with the same parallel layout?)")
    else:
        try:
            blob = torch.load(path, map_location="cpu")
        except Exception as e:  # a truncated or foreign file
            problem = f"{path} cannot be read ({type(e).__name__}: {e})"
        if problem is None and (not isinstance(blob, dict) or "optimizer" not in blob):
            problem = f"{path} is not a file written by save_optimizer"
        elif problem is None and (blob.get("data_parallel_size") != dps
                                  or blob.get("data_parallel_rank") != dp):
            problem = (f"{path} was saved by data-parallel rank {blob.get('data_parallel_rank')} "
                       f"of {blob.get('data_parallel_size')}, this is rank {dp} of {dps}: "
                       f"re-sharding is not supported")
    # every rank learns whether some rank cannot load, before the collective load starts
    comm = optimizer.comm
    bad = torch.zeros(comm.size, dtype=torch.float32)
    bad[comm.rank] = 1.0 if problem else 0.0
    comm.all_reduce(bad, op="max")
    if float(bad.sum()) != 0.0:
        who = [r for r in range(comm.size) if float(bad[r]) != 0.0]
        if problem is None:
            problem = (f"data-parallel rank(s) {who} cannot load their ScapeAdamS state from "
                       f"{directory} at iteration {iteration}; nothing was loaded")
        missing = problem.startswith("no ScapeAdamS state")
        raise (FileNotFoundError if missing else ValueError)(f"directory: {problem}")
    optimizer.load_state_dict(blob["optimizer"])
    return blob.get("extra")
