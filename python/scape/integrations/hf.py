"""Hugging Face ``transformers.Trainer`` with :class:`scape.optim.ScapeAdamS`.

One call: build :class:`ScapeTrainer` where you would build ``Trainer``, and start the ranks
with ``python3 -m scape.launch -n N train.py`` (or torchrun)::

    from scape.integrations.hf import ScapeTrainer
    trainer = ScapeTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                           scape_kwargs={"density": 0.01, "payload_dtype": "bf16"})
    trainer.train()                       # or trainer.train(resume_from_checkpoint=True)

What it changes in Trainer (docs/frameworks.md, "Hugging Face Trainer"):

- creates torch's process group if there is none (gloo, from the launcher's environment:
  :func:`scape.integrations.ensure_process_group`) and the SCAPE communicator beside it.
  ``TrainingArguments(...)`` already sets up accelerate's state, which creates the group
  itself, with MPI where torch has it (Debian's torch has not: gloo): call
  ``ensure_process_group()`` before building the arguments to be sure of gloo;
- builds ScapeAdamS from ``TrainingArguments`` (``learning_rate``, ``adam_beta1``,
  ``adam_beta2``, ``adam_epsilon``, ``weight_decay`` with Trainer's own two groups: no decay
  for biases and norms) plus ``scape_kwargs`` (``density``, ``warmup_steps``,
  ``payload_dtype``, ``sharded``, ...); ``optim`` in the arguments is ignored;
- hands ``max_grad_norm`` to ScapeAdamS (which clips the averaged, recovered gradient with
  one norm) and sets ``args.max_grad_norm = 0`` so that Trainer does not clip the raw local
  gradients;
- keeps DistributedDataParallel (which Trainer adds on several ranks) from all-reducing
  gradients: :func:`scape.integrations.keep_gradients_local` registers a communication hook
  that sends nothing, so a step's only gradient traffic is ScapeAdamS's sparse exchange;
- sets ``ddp_find_unused_parameters=False`` when the arguments leave it unset (Trainer's
  default for a ``PreTrainedModel`` is True, which makes DDP all-reduce a used-parameter map
  of one int per parameter tensor every step, although no gradient is reduced). A model with
  parameters that get no gradient in some steps needs ``ddp_find_unused_parameters=True``
  given explicitly (DDP then says so in its error); ScapeAdamS itself treats a missing
  gradient as zero;
- checkpoints: Trainer writes one ``optimizer.pt``, from rank 0, and every rank loads it. Before
  saving, every rank calls :meth:`ScapeAdamS.consolidate_state_dict`, so that file holds every
  rank's optimizer state (the error-feedback residuals differ per rank), and each rank's
  ``load_state_dict`` takes its own part: ``train(resume_from_checkpoint=...)`` continues
  bit-identically to an uninterrupted run on every rank (tests/python/test_frameworks.py).

Scheduler, logging, evaluation, gradient accumulation and the per-rank data shards are
Trainer's own. Needs transformers (4.38 tested) and accelerate (0.27 tested).
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Optional

import transformers

from ..optim import ScapeAdamS
from . import (communicator, ensure_process_group, keep_gradients_local,
               skip_bool_buffers_in_ddp)

__all__ = ["ScapeTrainer", "scape_optimizer", "compat_training_args"]


def scape_optimizer(optimizer: Any) -> ScapeAdamS:
    """The ScapeAdamS inside `optimizer` (accelerate wraps it in ``AcceleratedOptimizer``)."""
    opt = optimizer
    while not isinstance(opt, ScapeAdamS) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    if not isinstance(opt, ScapeAdamS):
        raise TypeError(f"expected a ScapeAdamS (or a wrapper of one), got "
                        f"{type(optimizer).__name__}")
    return opt


def compat_training_args(args: Any) -> Any:
    """Makes ``TrainingArguments`` usable on torch 1.x (Debian 12's 1.13): transformers 4.38
    passes ``prefetch_factor=None`` to ``DataLoader`` when ``dataloader_num_workers == 0``,
    which torch before 2.0 refuses; 2 (torch 1.x's default, the only value it takes there) is
    set instead. Applied by :class:`ScapeTrainer`; call it for a plain ``Trainer``. Returns
    `args`."""
    import torch

    if (int(torch.__version__.split(".")[0]) < 2 and args.dataloader_num_workers == 0
            and getattr(args, "dataloader_prefetch_factor", 2) is None):
        args.dataloader_prefetch_factor = 2
    return args


class ScapeTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose optimizer is :class:`scape.optim.ScapeAdamS` and whose
    data-parallel ranks exchange only what ScapeAdamS sends (see the module's docstring).

    Args:
        *args, **kwargs: as for ``transformers.Trainer``. ``optimizers=(opt, scheduler)`` may
            pass a ScapeAdamS built by hand (its own ``max_grad_norm`` then clips; Trainer's
            is turned off either way); with ``opt=None`` it is built from the arguments.
        comm: the :class:`scape.Communicator` of the data-parallel ranks (default:
            :meth:`scape.Communicator.from_env`, timeout from SCAPE_TIMEOUT_MS if set).
        scape_kwargs: keywords for ScapeAdamS on top of those taken from ``args`` (e.g.
            ``density``, ``warmup_steps``, ``payload_dtype``, ``sharded``, ``entering``).
            ``warmup_fraction`` or ``density_budget`` without ``total_steps`` takes
            Trainer's ``max_steps``.
    """

    def __init__(self, *args: Any, comm: Any = None,
                 scape_kwargs: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        ensure_process_group()
        super().__init__(*args, **kwargs)
        self.scape_comm = comm if comm is not None else communicator()
        self.scape_kwargs = dict(scape_kwargs or {})
        self._scape_total_steps: Optional[int] = None
        # ScapeAdamS clips the averaged gradient; Trainer would clip the raw local one
        self.scape_max_grad_norm = float(self.args.max_grad_norm or 0.0)
        self.args.max_grad_norm = 0.0
        compat_training_args(self.args)
        if self.args.ddp_find_unused_parameters is None:
            # nothing to find: the hook sends no gradient, so the map is traffic for nothing
            self.args.ddp_find_unused_parameters = False
        if self.optimizer is not None:
            opt = scape_optimizer(self.optimizer)
            mine = opt.param_groups[0].get("max_grad_norm", 0.0)
            if self.scape_max_grad_norm > 0 and float(mine or 0.0) != self.scape_max_grad_norm:
                warnings.warn(f"ScapeTrainer: TrainingArguments.max_grad_norm="
                              f"{self.scape_max_grad_norm} is not applied (Trainer's clipping "
                              f"is off): the given ScapeAdamS clips with its own "
                              f"max_grad_norm={mine}")

    def create_optimizer(self) -> Any:
        """Builds ScapeAdamS over the model's trainable parameters, two groups as Trainer
        makes them (weight decay except for biases and norm weights)."""
        if self.optimizer is None:
            model = self.model
            decay = set(self.get_decay_parameter_names(model))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            wd = float(self.args.weight_decay)
            groups = [{"params": [p for n, p in named if n in decay], "weight_decay": wd},
                      {"params": [p for n, p in named if n not in decay],
                       "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            kw: Dict[str, Any] = dict(lr=self.args.learning_rate,
                                      betas=(self.args.adam_beta1, self.args.adam_beta2),
                                      eps=self.args.adam_epsilon,
                                      max_grad_norm=self.scape_max_grad_norm)
            kw.update(self.scape_kwargs)
            if ((kw.get("warmup_fraction") is not None or kw.get("density_budget") is not None)
                    and kw.get("total_steps") is None):
                kw["total_steps"] = self._scape_total_steps
            self.optimizer = ScapeAdamS(groups, self.scape_comm, **kw)
        return self.optimizer

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """As Trainer's; remembers ``num_training_steps`` (Trainer's max_steps) as the
        ``total_steps`` of a ``warmup_fraction`` in scape_kwargs."""
        self._scape_total_steps = int(num_training_steps)
        super().create_optimizer_and_scheduler(num_training_steps)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        prepare_model = self.accelerator.prepare_model

        def prepare_model_keeping_gradients_local(model: Any, *a: Any, **k: Any) -> Any:
            return keep_gradients_local(prepare_model(skip_bool_buffers_in_ddp(model), *a, **k))

        self.accelerator.prepare_model = prepare_model_keeping_gradients_local

    def _save(self, output_dir: Optional[str] = None, state_dict: Any = None) -> None:
        # The parameters are views into ScapeAdamS's flat buffer, so they all share one
        # storage, which safetensors' shared-tensor check takes for tied weights (it would keep
        # one of them): save copies, one per distinct view (tied weights stay tied).
        if state_dict is None:
            state_dict = self.model.state_dict()
        copies: Dict[Any, Any] = {}
        out = {}
        for k, t in state_dict.items():
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
            if key not in copies:
                copies[key] = t.detach().clone()
            out[k] = copies[key]
        super()._save(output_dir, state_dict=out)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # every rank's optimizer state into the one optimizer.pt that rank 0 (or each node's
        # first rank with save_on_each_node) writes
        opt = scape_optimizer(self.optimizer)
        opt.consolidate_state_dict(to=None if self.args.save_on_each_node else 0)
        super()._save_optimizer_and_scheduler(output_dir)
