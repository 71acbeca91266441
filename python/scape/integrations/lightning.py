"""PyTorch Lightning with :class:`scape.optim.ScapeAdamS`: a strategy whose ranks exchange
only what ScapeAdamS sends.

Pass :class:`ScapeStrategy` where you would pass ``"ddp"`` and return ScapeAdamS from
``configure_optimizers``; start the ranks with ``python3 -m scape.launch -n N train.py``,
torchrun, Slurm, or let Lightning start them (plain ``python train.py`` with ``devices=N``)::

    import pytorch_lightning as pl            # or: import lightning.pytorch as pl
    from scape.integrations.lightning import ScapeStrategy

    class Net(pl.LightningModule):
        ...
        def configure_optimizers(self):
            # the strategy's communicator; max_grad_norm from Trainer(gradient_clip_val=...)
            return self.trainer.strategy.scape_optimizer(self.parameters(), lr=1e-3,
                                                         density=0.01, weight_decay=0.01)

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ScapeStrategy(),
                         accumulate_grad_batches=2, gradient_clip_val=1.0, max_epochs=4)
    trainer.fit(Net(), datamodule)            # or trainer.fit(..., ckpt_path="last.ckpt")

What the strategy does, against Lightning's ``DDPStrategy`` (which it subclasses: same
launchers, process group, cluster environments, distributed sampler, barrier, broadcast and
logging reductions):

- **No DistributedDataParallel wrapper.** ``configure_ddp`` leaves the LightningModule as it
  is, so backward writes each rank's own gradients into ScapeAdamS's flat buffer and nothing
  all-reduces them; the step's only gradient traffic is ScapeAdamS's sparse exchange. At
  setup it broadcasts rank 0's module buffers once (``sync_buffers=True``; DDP would
  broadcast them every forward: a BatchNorm's running statistics then stay per rank during
  training), and ScapeAdamS broadcasts rank 0's parameters when it is built. DDP's own
  options (``find_unused_parameters``, ``static_graph``, communication hooks, model
  averaging) do not apply and are refused.
- **The communicator.** After Lightning has created torch's process group
  (``setup_environment``), the strategy makes the :class:`scape.Communicator` of the same
  ranks from it (:meth:`scape.Communicator.from_process_group`: no extra rendezvous port) or
  takes the one given as ``comm``. It is ``trainer.strategy.scape_comm`` inside
  ``configure_optimizers``; ``trainer.strategy.scape_optimizer(params, **kwargs)`` builds
  ScapeAdamS over it.
- **Gradient accumulation** (``accumulate_grad_batches=k``): Lightning runs k micro-batches'
  forward and backward, which add into the flat gradient buffer locally (no DDP, so nothing is
  sent on a micro-batch), then calls ``optimizer.step`` once: ScapeAdamS exchanges once per
  global batch. Lightning divides each micro-batch's loss by k, as with DDP.
- **The closure**: Lightning's automatic optimization calls ``optimizer.step(closure)``, and
  ScapeAdamS runs the closure (training step and backward) before its exchange.
- **Gradient clipping**: ``Trainer(gradient_clip_val=c)`` (by norm, Lightning's default) is
  ScapeAdamS's ``max_grad_norm=c``: ScapeAdamS clips the averaged, recovered gradient with one
  global norm in its step, where Lightning would clip each rank's raw local gradient.
  ``scape_optimizer`` sets ``max_grad_norm`` from the Trainer; a ScapeAdamS built by hand
  must have ``max_grad_norm == gradient_clip_val`` or setup is refused (ValueError saying
  both values). The Trainer's own clipping is then off during ``fit``
  (``trainer.gradient_clip_val`` is None until teardown restores it).
  ``gradient_clip_algorithm="value"`` is refused: ScapeAdamS has no per-value clip of the
  averaged gradient.
- **Checkpoints**: Lightning saves one file, from global rank 0, that every rank loads. The
  error-feedback residuals and mask parts differ per rank, so ``optimizer_state`` first calls
  :meth:`ScapeAdamS.consolidate_state_dict` on every rank (collective, inside
  ``trainer.save_checkpoint``, which ModelCheckpoint calls on every rank); rank 0's file then
  holds every rank's state and each rank's ``load_state_dict`` takes its own part:
  ``trainer.fit(model, ckpt_path=...)`` resumes bit-identically to an uninterrupted run
  (tests/python/test_fw_lightning.py). Model weights, loops, schedulers and callbacks are
  Lightning's own.
- **Optimizer state moves**: Lightning's setup and teardown "move" every optimizer's state to
  the device (``optimizer.state[p] = moved``); ScapeAdamS's state lives in the library and
  accepts such an assignment because it changes nothing.

What it refuses, at setup (ValueError or TypeError naming the optimizer): an optimizer that is
not ScapeAdamS (without DDP nothing would average its gradients: the ranks would drift apart),
a ScapeAdamS over another communicator than the strategy's, clipping that ScapeAdamS cannot
apply (above). A ``configure_gradient_clipping`` override in the LightningModule is warned
about: whatever it clips is this rank's raw gradient before the exchange.

After ``fit``, on a GPU, Lightning's teardown moves the LightningModule to the CPU, which
takes the parameters out of ScapeAdamS's flat buffers: that ScapeAdamS cannot step again (a
new ``fit`` calls ``configure_optimizers`` again and builds a new one). :meth:`close` frees
the optimizers' library state and the communicator the strategy made.

Needs PyTorch Lightning 2.x, as ``pytorch_lightning`` or ``lightning.pytorch`` (both are
imported lazily: :data:`ScapeStrategy` is the class for whichever of the two is already
imported, else ``pytorch_lightning`` when installed, else ``lightning.pytorch``;
:func:`strategy_class` picks one explicitly). Tested here with pytorch-lightning 2.2.5 over
torch 1.13 on CPU, gloo, 2 ranks; nothing in it depends on that version.
"""
from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from typing import Any, Dict, Iterable, Optional

import torch

__all__ = ["ScapeStrategy", "strategy_class", "scape_optimizer"]

_FLAVOURS = ("pytorch_lightning", "lightning.pytorch")
_CLASSES: Dict[str, type] = {}

# DDPStrategy keywords that configure the DistributedDataParallel wrapper or its hooks: none
# applies without the wrapper
_DDP_ONLY = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


def _resolve_flavour(flavour: Optional[str]) -> str:
    if flavour is not None:
        if flavour not in _FLAVOURS:
            raise ValueError(f"strategy_class: flavour: expected one of {_FLAVOURS}, "
                             f"got {flavour!r}")
        return flavour
    loaded = [f for f in _FLAVOURS if f in sys.modules]
    if len(loaded) == 1:
        return loaded[0]
    for f in _FLAVOURS:
        try:
            importlib.import_module(f)
            return f
        except ImportError:
            continue
    raise ImportError("scape.integrations.lightning needs PyTorch Lightning 2.x: "
                      "pip install pytorch-lightning (or lightning)")


def _unwrap(opt: Any) -> Any:
    # LightningOptimizer keeps the user's optimizer as _optimizer
    while hasattr(opt, "_optimizer"):
        opt = opt._optimizer
    return opt


def _broadcast_buffers(module: torch.nn.Module, src: int = 0) -> int:
    """Broadcasts `module`'s buffers from rank `src` over torch's default group (bool buffers
    travel as uint8: gloo on torch 1.x has no bool). Returns the number broadcast."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0
    n = 0
    for b in module.buffers():
        if b.dtype == torch.bool:
            t = b.to(torch.uint8)
            dist.broadcast(t, src)
            b.copy_(t.bool())
        else:
            dist.broadcast(b.data, src)
        n += 1
    return n


def scape_optimizer(module_or_trainer: Any, params: Any = None, **kwargs: Any) -> Any:
    """ScapeAdamS for a LightningModule trained with :class:`ScapeStrategy`, for use in
    ``configure_optimizers``: ``return scape_optimizer(self, lr=1e-3, density=0.01)``.
    `params` defaults to the module's parameters that require gradients; see
    :meth:`ScapeStrategy.scape_optimizer` for the rest. Raises TypeError when the trainer's
    strategy is not a ScapeStrategy."""
    trainer = getattr(module_or_trainer, "trainer", module_or_trainer)
    strategy = getattr(trainer, "strategy", None)
    if not getattr(strategy, "_is_scape_strategy", False):
        raise TypeError(f"scape_optimizer: the trainer's strategy is "
                        f"{type(strategy).__name__}, not ScapeStrategy: pass "
                        f"Trainer(strategy=ScapeStrategy(...))")
    if params is None:
        if not isinstance(module_or_trainer, torch.nn.Module):
            raise TypeError("scape_optimizer: params is needed when called with a Trainer")
        params = [p for p in module_or_trainer.parameters() if p.requires_grad]
    return strategy.scape_optimizer(params, **kwargs)


def _build(flavour: str) -> type:
    pl = importlib.import_module(flavour)
    DDPStrategy = pl.strategies.DDPStrategy
    passthrough = set(inspect.signature(DDPStrategy.__init__).parameters) - {
        "self", "kwargs", *_DDP_ONLY}

    class ScapeStrategy(DDPStrategy):  # type: ignore[misc, valid-type]
        """Lightning's DDPStrategy without the DistributedDataParallel wrapper: gradients are
        exchanged by :class:`scape.optim.ScapeAdamS` (see :mod:`scape.integrations.lightning`).

        Args:
            comm: the :class:`scape.Communicator` of the data-parallel ranks (default: made at
                setup from torch's default process group, which Lightning creates,
                :meth:`scape.Communicator.from_process_group`; the strategy then owns it).
            comm_backend: "ucx" (default) or "nccl", for the communicator it makes.
            comm_timeout_ms: the communicator's timeout (default: the library's, or
                SCAPE_TIMEOUT_MS).
            sync_buffers: broadcast rank 0's module buffers once at setup (default True).
            **kwargs: DDPStrategy's own keywords that do not configure the DDP wrapper
                (``accelerator``, ``parallel_devices``, ``cluster_environment``,
                ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``,
                ``timeout``, ``start_method``); DDP's options are refused (TypeError).
        """

        _is_scape_strategy = True
        strategy_name = "scape"

        def __init__(self, comm: Any = None, *, comm_backend: str = "ucx",
                     comm_timeout_ms: Optional[int] = None, sync_buffers: bool = True,
                     **kwargs: Any) -> None:
            bad = sorted(k for k in kwargs if k not in passthrough)
            if bad:
                raise TypeError(f"ScapeStrategy: {', '.join(bad)}: not accepted: the module is "
                                f"not wrapped in DistributedDataParallel (ScapeAdamS exchanges "
                                f"the gradients), so DDP's options and hooks do not apply; "
                                f"accepted: {sorted(passthrough)}")
            if comm is not None:
                from ..comm import Communicator

                if not isinstance(comm, Communicator):
                    raise TypeError(f"ScapeStrategy: comm: expected a scape.Communicator, got "
                                    f"{type(comm).__name__}")
            if comm_backend not in ("ucx", "nccl"):
                raise ValueError(f"ScapeStrategy: comm_backend: expected 'ucx' or 'nccl', got "
                                 f"{comm_backend!r}")
            super().__init__(**kwargs)
            self._scape_comm = comm
            self._scape_owns_comm = False
            self._scape_comm_backend = comm_backend
            self._scape_timeout_ms = comm_timeout_ms
            self._scape_sync_buffers = bool(sync_buffers)
            self._scape_saved_clip: Optional[tuple] = None

        # -- the communicator ------------------------------------------------------------

        def setup_distributed(self) -> None:
            super().setup_distributed()
            if self._scape_comm is None or not self._scape_comm.alive:
                import os

                from ..comm import Communicator

                t = self._scape_timeout_ms
                if t is None and os.environ.get("SCAPE_TIMEOUT_MS"):
                    t = int(os.environ["SCAPE_TIMEOUT_MS"])
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    self._scape_comm = Communicator.from_process_group(
                        None, backend=self._scape_comm_backend, timeout_ms=t)
                else:  # one process, no group: a communicator of one rank
                    self._scape_comm = Communicator.from_env(
                        backend=self._scape_comm_backend, timeout_ms=t)
                self._scape_owns_comm = True
            if (self._scape_comm.size != self.world_size
                    or self._scape_comm.rank != self.global_rank):
                raise ValueError(f"ScapeStrategy: the communicator is rank "
                                 f"{self._scape_comm.rank} of {self._scape_comm.size}, "
                                 f"Lightning's process is global rank {self.global_rank} of "
                                 f"{self.world_size}: they must be the same ranks")

        @property
        def scape_comm(self) -> Any:
            """The :class:`scape.Communicator` of the data-parallel ranks (available from
            Lightning's setup on: inside ``configure_optimizers`` and later)."""
            if self._scape_comm is None:
                raise RuntimeError("ScapeStrategy.scape_comm: not set up yet (the communicator "
                                   "is made when the Trainer sets up the process group: use it "
                                   "from configure_optimizers on)")
            return self._scape_comm

        def scape_optimizer(self, params: Iterable[Any], **kwargs: Any) -> Any:
            """``ScapeAdamS(params, self.scape_comm, **kwargs)``, with ``max_grad_norm`` from
            ``Trainer(gradient_clip_val=...)`` unless given (clipping by value is refused)."""
            from ..optim import ScapeAdamS

            module = self.lightning_module
            trainer = getattr(module, "_trainer", None) if module is not None else None
            if "max_grad_norm" not in kwargs and trainer is not None:
                clip = self._trainer_clip(trainer)
                if clip:
                    kwargs["max_grad_norm"] = clip
            return ScapeAdamS(params, self.scape_comm, **kwargs)

        # -- no DDP wrapper --------------------------------------------------------------

        def configure_ddp(self) -> None:
            # the module stays unwrapped: its gradients stay local until ScapeAdamS's step
            if self._scape_sync_buffers and self.model is not None:
                with torch.no_grad():
                    _broadcast_buffers(self.model)

        # -- optimizers and clipping -----------------------------------------------------

        @staticmethod
        def _trainer_clip(trainer: Any) -> float:
            val = getattr(trainer, "gradient_clip_val", None)
            if not val:
                return 0.0
            alg = getattr(trainer, "gradient_clip_algorithm", None)
            alg = str(getattr(alg, "value", alg) or "norm").lower()
            if alg != "norm":
                raise ValueError(f"ScapeStrategy: Trainer(gradient_clip_algorithm={alg!r}) "
                                 f"cannot be applied: ScapeAdamS clips the averaged gradient "
                                 f"in its step by global norm only (max_grad_norm); use "
                                 f"gradient_clip_algorithm='norm' or no clipping")
            return float(val)

        def setup_optimizers(self, trainer: Any) -> None:
            super().setup_optimizers(trainer)
            from ..optim import ScapeAdamS

            if trainer.state.fn != "fit":
                return
            clip = self._trainer_clip(trainer)
            for i, opt in enumerate(self.optimizers):
                o = _unwrap(opt)
                if not isinstance(o, ScapeAdamS):
                    raise TypeError(f"ScapeStrategy: optimizer {i} is {type(o).__name__}, not "
                                    f"scape.optim.ScapeAdamS: without DistributedDataParallel "
                                    f"nothing would average its gradients and the ranks would "
                                    f"drift apart; return ScapeAdamS from configure_optimizers "
                                    f"(trainer.strategy.scape_optimizer(params, ...)) or use "
                                    f"strategy='ddp'")
                if o.comm is not self._scape_comm:
                    raise ValueError(f"ScapeStrategy: optimizer {i} (ScapeAdamS) was built "
                                     f"over another communicator than the strategy's: build it "
                                     f"with trainer.strategy.scape_comm")
                mine = float(o.param_groups[0].get("max_grad_norm") or 0.0)
                if clip and mine != clip:
                    raise ValueError(f"ScapeStrategy: Trainer(gradient_clip_val={clip}) but "
                                     f"optimizer {i} (ScapeAdamS) has max_grad_norm={mine}: "
                                     f"ScapeAdamS clips the averaged gradient in its step, "
                                     f"Lightning would clip each rank's raw local gradient; "
                                     f"build it with max_grad_norm={clip} "
                                     f"(trainer.strategy.scape_optimizer does)")
            if clip:
                # ScapeAdamS clips; Lightning's clip of the raw gradients is off during fit
                self._scape_saved_clip = (trainer, trainer.gradient_clip_val)
                trainer.gradient_clip_val = None
            module = self.lightning_module
            if module is not None:
                base = pl.LightningModule.configure_gradient_clipping
                if getattr(type(module), "configure_gradient_clipping", base) is not base:
                    warnings.warn("ScapeStrategy: the LightningModule overrides "
                                  "configure_gradient_clipping: whatever it clips is this "
                                  "rank's raw local gradient before ScapeAdamS's exchange; "
                                  "ScapeAdamS's max_grad_norm clips the averaged gradient")

        # -- checkpoints -----------------------------------------------------------------

        def optimizer_state(self, optimizer: Any) -> Dict[str, Any]:
            """Every rank's ScapeAdamS state, on global rank 0 (the rank that writes the
            checkpoint): collective, every rank calls it inside ``save_checkpoint``."""
            from ..optim import ScapeAdamS

            o = _unwrap(optimizer)
            if isinstance(o, ScapeAdamS):
                o.consolidate_state_dict(to=0)
                return o.state_dict()
            return super().optimizer_state(optimizer)

        # -- lifetime --------------------------------------------------------------------

        def teardown(self) -> None:
            saved, self._scape_saved_clip = self._scape_saved_clip, None
            if saved is not None:
                saved[0].gradient_clip_val = saved[1]
            super().teardown()

        def close(self) -> None:
            """Frees the library state of this strategy's ScapeAdamS optimizers and the
            communicator the strategy made (not one passed as ``comm``). Collective; call it
            after the last use of the trainer (its optimizers cannot step or save after)."""
            from ..optim import ScapeAdamS

            for opt in list(getattr(self, "optimizers", []) or []):
                o = _unwrap(opt)
                if isinstance(o, ScapeAdamS):
                    o.destroy()
            if self._scape_owns_comm and self._scape_comm is not None:
                self._scape_comm.destroy()
                self._scape_comm = None
                self._scape_owns_comm = False

    ScapeStrategy.__module__ = __name__
    ScapeStrategy.__qualname__ = "ScapeStrategy"
    return ScapeStrategy


def strategy_class(flavour: Optional[str] = None) -> type:
    """The ScapeStrategy class for `flavour`: "pytorch_lightning" or "lightning.pytorch"
    (None: the one already imported, else whichever is installed, pytorch_lightning first).
    A Trainer takes only a strategy of its own package."""
    f = _resolve_flavour(flavour)
    if f not in _CLASSES:
        _CLASSES[f] = _build(f)
    return _CLASSES[f]


def __getattr__(name: str) -> Any:
    if name == "ScapeStrategy":
        return strategy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
