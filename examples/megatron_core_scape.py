"""megatron-core's GPTModel trained with ScapeAdamS: the route of docs/frameworks.md,
"megatron-core".

    python3 -m scape.launch -n 2 examples/megatron_core_scape.py
    python3 -m scape.launch -n 2 examples/megatron_core_scape.py --check-resume --dense-baseline

A tiny GPTModel (megatron-core's own, local layer spec, learned absolute positions, built in
code) learns to count (a synthetic sequence task) on 2 data-parallel ranks (TP = PP = 1). The
optimizer is `scape.integrations.megatron.scape_optimizer`: ScapeAdamS over megatron-core's
parameter groups and the data-parallel group's communicator. Each step is megatron-core's
own schedule (`get_forward_backward_func()`, 2 micro-batches whose gradients accumulate)
followed by `opt.step()`. The model is not wrapped in Megatron's DistributedDataParallel and
finalize_model_grads is not called (`config.finalize_model_grads_func` stays None). The
script checks, and exits non-zero otherwise:

- no gradient all-reduce by the framework in a training step (torch.distributed's all_reduce
  and reduce-scatter calls are counted from forward to the end of opt.step(): 0 with ScapeAdamS;
  the dense baseline, Megatron's DDP, shows its own);
- the parameter groups equal megatron-core's own (its private `_get_param_groups`, where the
  installed version has it);
- the loss falls, and the parameters are bit-identical on every rank;
- with --check-resume: a run stopped at half the steps, saved (the model as Megatron's
  `model_optim_rng.pt`, the optimizer by `save_optimizer` beside it) and resumed into a fresh
  model and optimizer ends with the same bits as the uninterrupted run, on every rank;
- with --dense-baseline: at density 1.0, the losses equal those of megatron-core's own dense
  data parallelism (its DistributedDataParallel, with the schedule calling
  finalize_model_grads: gradients averaged by torch.distributed) with the same AdamS update
  (`scape.integrations.reference.TorchAdamS`) to fp32 rounding (relative tolerance
  --dense-rtol);
- with --check-refusals: what the integration refuses (a model in Megatron's or torch's DDP,
  config.finalize_model_grads_func or gradient_accumulation_fusion set,
  use_distributed_optimizer, fp16, a missing
  checkpoint) is refused on every rank with an error naming the argument.

--bf16 trains Megatron-LM's mixed precision way (bf16 TransformerConfig, Float16Module) with
ScapeAdamS's fp32 master weights; --sharded uses ScapeAdamS's ZeRO-1 style update.

With CUDA, the script takes the GPU route (NCCL process group, CUDA parameters, a
`backend="nccl"` communicator, no patches); that route has not been run yet. On a CPU-only
torch 1.x, megatron-core 0.8.0 needs the patches in
tests/python/frameworks/cpu_patches_megatron.py, which the test applies through
tests/python/frameworks/run_patched.py.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Dict, List

import torch
import torch.distributed as dist

from scape.integrations import ensure_process_group
from scape.integrations.megatron import (data_parallel_communicator, load_optimizer,
                                         param_groups, save_optimizer, scape_optimizer)

VOCAB, SEQ = 64, 16


# -- counting the framework's collectives ----------------------------------------------------

class CollectiveCounter:
    """Wraps torch.distributed's gradient-reducing collectives (all_reduce, the reduce-scatters,
    the coalesced all-reduce) to count the calls and elements over a group of more than one
    rank while `active` is True. Collectives over a one-rank group move nothing: megatron-core's
    vocab-parallel cross entropy all-reduces three small tensors per forward over the
    tensor-parallel group, of one rank at TP = 1 (`single` counts those)."""

    NAMES = ("all_reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor",
             "_reduce_scatter_base")

    def __init__(self) -> None:
        self.active = False
        self.calls = self.elements = self.single = 0
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(fn))

    def reset(self) -> None:
        self.calls = self.elements = self.single = 0

    def _wrap(self, fn):
        def counted(tensor, *a, **kw):
            if self.active:
                group = kw.get("group")
                if group is None and len(a) >= 2 and not isinstance(a[1], bool):
                    group = a[1]  # all_reduce(tensor, op, group)
                if dist.get_world_size(group) > 1:
                    self.calls += 1
                    ts = tensor if isinstance(tensor, (list, tuple)) else [tensor]
                    self.elements += sum(t.numel() for t in ts if isinstance(t, torch.Tensor))
                else:
                    self.single += 1
            return fn(tensor, *a, **kw)
        return counted


# -- data and model -------------------------------------------------------------------------

def counting_rows(n: int, seed: int = 1234) -> torch.Tensor:
    """`n` sequences of SEQ tokens counting up by a stride of 1 or 2 (mod VOCAB) from a random
    start, 5% of tokens replaced by noise: learnable within a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 3, (n, 1), generator=g)
    rows = (start + stride * torch.arange(SEQ)) % VOCAB
    noise = torch.rand(n, SEQ, generator=g) < 0.05
    rows[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=g)
    return rows


def build_model(seed: int, device: torch.device, bf16: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=True, hidden_dropout=0.0,
                            attention_dropout=0.0, bf16=bf16,
                            params_dtype=torch.bfloat16 if bf16 else torch.float32,
                            pipeline_dtype=torch.bfloat16 if bf16 else torch.float32)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="learned_absolute")
    model = model.to(device)
    if bf16:  # as Megatron-LM does: the module in bf16, fp32 logits out
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
    return model


class Batches:
    """Step i's batch of this data-parallel rank: rows [(i*dp + r)*b, +b) of the data."""

    def __init__(self, rows: torch.Tensor, batch: int, dp_rank: int, dp_size: int,
                 device: torch.device) -> None:
        self.rows, self.b, self.r, self.n, self.device = rows, batch, dp_rank, dp_size, device
        self.pos = torch.arange(SEQ, device=device).unsqueeze(0).expand(batch, SEQ)
        # megatron-core's mask convention: True where attention is NOT allowed
        self.mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=device),
                               1).view(1, 1, SEQ, SEQ)

    def __call__(self, i: int) -> torch.Tensor:
        start = ((i * self.n + self.r) * self.b) % (self.rows.shape[0] - self.b + 1)
        return self.rows[start:start + self.b].to(self.device)


def forward_backward(model, tokens: torch.Tensor, data: Batches, micro: int) -> float:
    """One global batch's forward and backward through megatron-core's own schedule
    (get_forward_backward_func: here forward_backward_no_pipelining), in `micro`
    micro-batches whose gradients accumulate (each loss divided by `micro`, Megatron's rule).
    The schedule calls config.finalize_model_grads_func after the last backward when it is set
    (Megatron's DDP run) and not otherwise (ScapeAdamS). Returns this rank's mean loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n = tokens.shape[0] // micro

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        # next-token loss: megatron's GPTModel returns the per-token cross entropy [b, s]
        per_token = model(mb[:, :-1], data.pos[:n, :-1], data.mask[..., :-1, :-1],
                          labels=mb[:, 1:])

        def loss_func(output):
            loss = output.float().mean()
            # a copy: the schedule divides `loss` in place by the number of micro-batches
            return loss, {"lm loss": loss.detach().clone()}
        return per_token, loss_func

    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(tokens.split(n)), model=[model],
        num_microbatches=micro, seq_length=SEQ - 1, micro_batch_size=n, forward_only=False)
    return float(sum(float(d["lm loss"]) for d in out) / micro)


def mean_over(comm, x: float) -> float:
    t = torch.tensor([x], dtype=torch.float32)
    comm.all_reduce(t, op="avg")
    return float(t[0])


def all_equal_over(comm, text: str) -> bool:
    mine = torch.tensor([int(text[i:i + 6], 16) for i in range(0, 60, 6)], dtype=torch.int32)
    every = torch.zeros(comm.size * mine.numel(), dtype=torch.int32)
    comm.all_gather(mine, every)
    return bool((every.view(comm.size, -1) == mine).all())


# -- the runs -------------------------------------------------------------------------------

def optimizer_config(a):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(lr=a.lr, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                           adam_eps=a.eps, clip_grad=a.clip_grad)


def train_scape(a, comm, data, counter, steps: range, density: float, resume_from=None,
                save_at=None, ckpt=None) -> Dict:
    """ScapeAdamS over megatron-core's groups; the steps in `steps`. With `resume_from`, the
    model and optimizer are first loaded from `ckpt` at that iteration; with `save_at`, both
    are saved after that many steps."""
    device = data.device
    model = build_model(a.seed, device, bf16=a.bf16)
    opt = scape_optimizer([model], optimizer_config(a), comm=comm, density=density,
                          warmup_steps=a.warmup, sharded=a.sharded)
    if resume_from is not None:
        path = os.path.join(ckpt, f"iter_{resume_from:07d}", "mp_rank_00", "model_optim_rng.pt")
        state = torch.load(path, map_location=device)
        model.load_state_dict(state["model"])
        load_optimizer(opt, ckpt, resume_from)
    losses: List[float] = []
    for it in steps:
        tokens = data(it)
        opt.zero_grad()
        counter.active = True
        loss = forward_backward(model, tokens, data, a.micro)
        opt.step()
        counter.active = False
        losses.append(mean_over(comm, loss))
        if a.log_every and (it + 1) % a.log_every == 0 and comm.rank == 0:
            print(f"  step {it + 1}: loss {losses[-1]:.4f}  bytes sent {opt.bytes_sent()}",
                  flush=True)
        if save_at is not None and it + 1 == save_at:
            from megatron.core import parallel_state

            if parallel_state.get_data_parallel_rank() == 0:  # Megatron: DP rank 0 saves
                d = os.path.join(ckpt, f"iter_{save_at:07d}", "mp_rank_00")
                os.makedirs(d, exist_ok=True)
                torch.save({"model": model.state_dict(), "iteration": save_at},
                           os.path.join(d, "model_optim_rng.pt"))
            p = save_optimizer(opt, ckpt, save_at)
            if comm.rank == 0:
                print(f"  saved iteration {save_at}: {os.path.relpath(p, ckpt)} (one per rank)",
                      flush=True)
            comm.barrier()  # every rank's file is written before anyone goes on
    out = {"losses": losses, "hash": opt.parameter_hash(), "model": model, "opt": opt}
    return out


def train_dense_megatron(a, data, counter, steps: int) -> List[float]:
    """megatron-core's own data parallelism: its DistributedDataParallel, finalize_model_grads
    (the dense gradient all-reduce, averaged), clipping of the averaged gradient, and the
    same AdamS update as plain torch (TorchAdamS) over the same parameter groups."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads

    from scape.integrations.reference import TorchAdamS

    model = build_model(a.seed, data.device)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    # what Megatron-LM's training loop sets: the schedule syncs gradients through these
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    cfg = optimizer_config(a)
    opt = TorchAdamS(param_groups([model], lr=cfg.lr, weight_decay=cfg.weight_decay),
                     lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    params = [p for g in opt.param_groups for p in g["params"]]
    losses = []
    for it in range(steps):
        tokens = data(it)
        ddp.zero_grad_buffer()
        counter.active = True
        loss = forward_backward(ddp, tokens, data, a.micro)  # finalize_model_grads inside
        for p in params:  # what Megatron's FP32Optimizer does (it needs CUDA in 0.8)
            p.grad = p.main_grad
        torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad)
        opt.step()
        for p in params:  # Megatron's optimizer zero_grad(set_to_none=True): else the next
            p.grad = None  # backward accumulates into main_grad through this alias, and DDP's
        counter.active = False  # hook adds it to main_grad once more
        t = torch.tensor([loss], device=data.device)  # NCCL needs a CUDA tensor
        dist.all_reduce(t)  # outside the counted window
        losses.append(float(t[0]) / dist.get_world_size())
    return losses


def check_refusals(a, comm, data) -> List[str]:
    """What scape_optimizer and load_optimizer refuse: returns the failures (empty: all
    refused, each with an error naming the argument)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    bad = []

    def expect(what, exc, words, fn):
        try:
            fn()
        except exc as e:
            if not all(w in str(e) for w in words):
                bad.append(f"{what}: message {str(e)!r} lacks {words}")
            return
        except Exception as e:  # the wrong kind of error
            bad.append(f"{what}: raised {type(e).__name__}: {e}")
            return
        bad.append(f"{what}: not refused")

    model = build_model(a.seed, data.device)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    expect("a model in megatron's DDP", ValueError,
           ["model_chunks[0]", "megatron-core's DistributedDataParallel", "finalize_model_grads"],
           lambda: scape_optimizer([ddp], OptimizerConfig(lr=1e-3), comm=comm))
    tddp = torch.nn.parallel.DistributedDataParallel(build_model(a.seed, data.device))
    expect("a model in torch's DDP", ValueError,
           ["model_chunks[0]", "torch's DistributedDataParallel"],
           lambda: scape_optimizer(tddp, OptimizerConfig(lr=1e-3), comm=comm))
    from megatron.core.distributed import finalize_model_grads

    other = build_model(a.seed, data.device)
    other.config.finalize_model_grads_func = finalize_model_grads
    expect("config.finalize_model_grads_func set", ValueError,
           ["model_chunks[0].config.finalize_model_grads_func"],
           lambda: scape_optimizer([other], OptimizerConfig(lr=1e-3), comm=comm))
    fused = build_model(a.seed, data.device)
    fused.config.gradient_accumulation_fusion = True
    expect("gradient_accumulation_fusion", ValueError,
           ["model_chunks[0].config.gradient_accumulation_fusion", "grad_dtype=torch.float32"],
           lambda: scape_optimizer([fused], OptimizerConfig(lr=1e-3), comm=comm))
    expect("use_distributed_optimizer", ValueError, ["config.use_distributed_optimizer",
                                                     "sharded=True"],
           lambda: scape_optimizer([model], OptimizerConfig(
               lr=1e-3, use_distributed_optimizer=True), comm=comm))
    expect("fp16", ValueError, ["config.fp16"],
           lambda: scape_optimizer([model], OptimizerConfig(lr=1e-3, fp16=True), comm=comm))
    expect("lr as a keyword", ValueError, ["lr: comes from config"],
           lambda: scape_optimizer([model], OptimizerConfig(lr=1e-3), comm=comm, lr=0.1))
    opt = scape_optimizer([model], OptimizerConfig(lr=1e-3), comm=comm, density=0.5)
    empty = tempfile.mkdtemp(prefix="scape_mcore_empty_")
    # every rank raises, none hangs in the collective load
    expect("a missing checkpoint", FileNotFoundError, ["directory:", "iter_0000007"],
           lambda: load_optimizer(opt, empty, 7))
    shutil.rmtree(empty, ignore_errors=True)
    opt.destroy()
    return bad


def check_param_groups(model) -> str:
    """Our groups against megatron-core's private _get_param_groups, where it exists with the
    0.8 signature: the same parameters with the same wd_mult and lr_mult."""
    try:
        from megatron.core.optimizer import _get_param_groups
        theirs = _get_param_groups([model], None, None, 1.0, False)
    except (ImportError, TypeError) as e:
        return f"not compared ({type(e).__name__}: {e})"
    ours = param_groups([model], lr=1.0, weight_decay=1.0)
    # and with the fine-tuning conditions: the head at half the lr, no decay for embeddings
    head = lambda n, p: "output_layer." in n  # noqa: E731
    no_wd = lambda n, p: "embedding" in n or n.endswith(".bias")  # noqa: E731
    theirs2 = _get_param_groups([model], no_wd, head, 0.5, False)
    ours2 = param_groups([model], lr=1.0, weight_decay=1.0, no_weight_decay_cond=no_wd,
                         scale_lr_cond=head, lr_mult=0.5)

    def key(gs):  # (wd_mult, lr_mult) -> the parameters (ours may split a key by dtype)
        out = {}
        for g in gs:
            out.setdefault((g["wd_mult"], g["lr_mult"]), set()).update(id(p) for p in g["params"])
        return out
    return str(key(ours) == key(theirs) and key(ours2) == key(theirs2)
               and len(key(ours2)) == 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--micro", type=int, default=2,
                    help="micro-batches per step (gradient accumulation in Megatron's schedule)")
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=2, help="ScapeAdamS warmup_steps")
    ap.add_argument("--eps", type=float, default=1e-8, help="OptimizerConfig.adam_eps")
    ap.add_argument("--clip-grad", type=float, default=1.0, help="OptimizerConfig.clip_grad")
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 parameters (TransformerConfig bf16, params_dtype); ScapeAdamS "
                         "keeps the fp32 master weights")
    ap.add_argument("--sharded", action="store_true",
                    help="ScapeAdamS(sharded=True): the ZeRO-1 style update (same bits)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=4)
    ap.add_argument("--check-resume", action="store_true")
    ap.add_argument("--dense-baseline", action="store_true")
    ap.add_argument("--check-refusals", action="store_true",
                    help="check what scape_optimizer and load_optimizer refuse")
    ap.add_argument("--dense-rtol", type=float, default=1e-5,
                    help="relative tolerance of the density-1.0 losses against the dense run")
    ap.add_argument("--ckpt-dir", default=None, help="default: a temporary folder")
    a = ap.parse_args()
    if a.steps < 2 or a.steps % 2:
        ap.error("--steps: expected an even number >= 2 (resume is checked at half)")
    if a.micro < 1 or a.batch % a.micro:
        ap.error(f"--micro: expected a divisor of --batch ({a.batch}), got {a.micro}")

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    ensure_process_group("nccl" if cuda else "gloo")
    if not dist.is_initialized():  # one rank: megatron-core still wants a group
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=1)
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(a.seed)
    comm = data_parallel_communicator(**({"backend": "nccl"} if cuda else {}))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), comm.size
    data = Batches(counting_rows(1024), a.batch, dp_rank, dp_size, device)
    counter = CollectiveCounter()
    rank0 = comm.rank == 0
    ok = True

    def say(line: str) -> None:
        if rank0:
            print(line, flush=True)

    say(f"megatron-core GPTModel, {dp_size} data-parallel ranks (TP = PP = 1), "
        f"device {device}, density {a.density}{', sharded' if a.sharded else ''}")
    run = train_scape(a, comm, data, counter, range(a.steps), a.density)
    n_params = sum(p.numel() for p in run["model"].parameters())
    groups = run["opt"].param_groups
    say(f"parameters: {n_params}; groups: " + ", ".join(
        f"{len(g['params'])} tensors wd_mult {g['wd_mult']} weight_decay {g['weight_decay']} "
        f"{str(g['params'][0].dtype).replace('torch.', '')}"
        f"{' (fp32 masters in ScapeAdamS)' if m is not None else ''}"
        for g, m in zip(groups, run["opt"].master_weights())))
    same_groups = check_param_groups(run["model"])
    say(f"param groups equal megatron-core's _get_param_groups: {same_groups}")
    ok &= same_groups != "False"
    say(f"framework gradient all-reduces in {a.steps} training steps: {counter.calls} "
        f"({counter.elements} elements; {counter.single} collectives over one-rank groups)")
    ok &= counter.calls == 0
    first, last = run["losses"][0], sum(run["losses"][-3:]) / 3
    falls = last < first - 0.1
    say(f"loss falls: {falls} ({first:.4f} -> {last:.4f}, mean of the last 3 steps)")
    ok &= falls
    same = all_equal_over(comm, run["hash"])
    say(f"ranks identical: {same}")
    ok &= same

    if a.check_resume:
        ckpt = a.ckpt_dir or (tempfile.mkdtemp(prefix="scape_mcore_") if rank0 else None)
        box = [ckpt]
        dist.broadcast_object_list(box, src=0)  # the folder's name, once, outside training
        ckpt = box[0]
        half = a.steps // 2
        counter.reset()
        first_half = train_scape(a, comm, data, counter, range(half), a.density,
                                 save_at=half, ckpt=ckpt)
        first_half["opt"].destroy()
        resumed = train_scape(a, comm, data, counter, range(half, a.steps), a.density,
                              resume_from=half, ckpt=ckpt)
        bit = resumed["hash"] == run["hash"]
        print(f"rank {comm.rank}: resume from iteration {half} bit-identical to the "
              f"uninterrupted run: {bit}", flush=True)
        every = mean_over(comm, 1.0 if bit else 0.0) == 1.0
        say(f"resume bit-identical on every rank: {every}")
        ok &= every and resumed["losses"] == run["losses"][half:]
        say(f"resumed losses equal the uninterrupted run's: "
            f"{resumed['losses'] == run['losses'][half:]}")
        ok &= counter.calls == 0
        resumed["opt"].destroy()
        if rank0 and a.ckpt_dir is None:
            shutil.rmtree(ckpt, ignore_errors=True)

    if a.dense_baseline:
        run["opt"].destroy()
        counter.reset()
        ones = train_scape(a, comm, data, counter, range(a.steps), 1.0)
        ones["opt"].destroy()
        scape_calls = counter.calls
        counter.reset()
        dense = train_dense_megatron(a, data, counter, a.steps)
        say(f"dense baseline (megatron DDP + finalize_model_grads + TorchAdamS): framework "
            f"gradient all-reduces in {a.steps} steps: {counter.calls} "
            f"({counter.elements} elements); ScapeAdamS at density 1.0: {scape_calls}")
        ok &= counter.calls > 0 and scape_calls == 0  # the counter sees Megatron's
        diff = max(abs(x - y) / abs(y) for x, y in zip(ones["losses"], dense))
        close = diff <= a.dense_rtol
        say(f"density 1.0 losses: {' '.join(f'{x:.6f}' for x in ones['losses'])}")
        say(f"dense run losses:   {' '.join(f'{x:.6f}' for x in dense)}")
        say(f"density 1.0 equals the dense run: {close} (max relative difference {diff:.2e}, "
            f"tolerance {a.dense_rtol:g})")
        ok &= close

    if a.check_refusals:
        bad = check_refusals(a, comm, data)
        for b in bad:
            print(f"rank {comm.rank}: refusal check failed: {b}", flush=True)
        every = mean_over(comm, 0.0 if bad else 1.0) == 1.0
        say(f"refusals (megatron DDP, torch DDP, finalize_model_grads_func, "
            f"gradient_accumulation_fusion, use_distributed_optimizer, fp16, lr keyword, "
            f"missing checkpoint) with clear errors on every rank: {every}")
        ok &= every

    say(f"all checks passed: {bool(ok)}")
    comm.destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
