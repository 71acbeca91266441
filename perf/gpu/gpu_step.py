"""The optimizer step on device, a Python twin of `scape-perf --mode step` on torch tensors
(CUDA on a GPU, CPU for the dry run), one process per rank
(``python3 -m scape.launch -n 4 perf/gpu/gpu_step.py --params 268435456 ...``).

One run, the same parameters and gradients for every row, rows one after the other:

  adams-dense   the library's step with every tensor dense (ScapeAdamS(dense=lambda p: True,
                density=1): no top-k, every value exchanged, fp32) -- the dense AdamS step
  scape-<d>     ScapeAdamS at density d (1, 0.1, 0.01 by default; bf16 payload by default;
                1-D tensors dense, as in training), fixed density from step 1
  adamw-nccl    torch: all-reduce of the flat fp32 gradient (torch.distributed: NCCL on a GPU,
                gloo on the CPU), clip to norm 1, torch.optim.AdamW (fused on a GPU)

Parameters: --params fp32 values in --segments equal 2-D tensors plus one 1-D tensor of 4096
(a norm, always dense), as scape-perf lays them out; lr 1e-4, betas (0.9, 0.95), eps 1e-8,
weight decay 0.1, clip 1.0 everywhere. Gradients: fresh N(0, 0.01^2) values per rank and step,
written before the clock starts. A step is timed from a barrier to the end of the step with the
device synchronised; each iteration's time is the slowest rank's; the row reports the median
over --iters timed steps after --warmup untimed ones (>= 2: step 0 is always dense), with the
library's phases (ScapeAdamS.info(), rank 0's mean per phase) and the bytes rank 0 sent. After
the timed steps the parameters must be identical on every rank (a position-weighted checksum
of their bits). Rank 0 appends one JSON line per row to OUT/step_bench.jsonl.

Memory (fp32, per rank): ScapeAdamS holds parameters, gradients, momentum and residual
(16 B per parameter), the owned top-k statistic (4/P B) and, per selected position, its index
(8 B) and payload (2-4 B): ~17 B per parameter at density 0.01, up to ~28 B at density 1 (every
position selected). torch AdamW holds parameters, gradients and two moments (16 B, plus the
flat copy made here). Budget: 28 B per parameter per rank, so 256 Mi parameters take up to
~7 GiB per rank, ~28 GiB for 4 ranks plus 4 CUDA contexts and NCCL's buffers (~6 GiB): an
H100 (78 GiB) holds it; 1 Gi parameters take up to ~112 + 6 GiB for 4 ranks: only an H200
(139 GiB). The run checks the free memory first and records each row's peak
(torch.cuda.max_memory_allocated, the slowest rank's) and the library's state, mask-state and
scratch bytes (ScapeAdamS.info()).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu_common as gc  # noqa: E402

LR, BETAS, EPS, WD, CLIP = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0
BYTES_PER_PARAM = 28.0  # see the module's docstring


def layout(n: int, segments: int) -> List[torch.Size]:
    """`segments` 2-D tensors (rows of 1024 where possible) and a 1-D tensor of 4096."""
    dense = min(4096, n // 2)
    rest = n - dense
    shapes: List[torch.Size] = []
    per = max(1, rest // segments)
    left = rest
    for i in range(segments):
        k = per if i < segments - 1 else left
        if k <= 0:
            break
        shapes.append(torch.Size((k // 1024, 1024)) if k % 1024 == 0 else torch.Size((k, 1)))
        left -= k
    shapes.append(torch.Size((dense,)))
    return shapes


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.t_start = time.monotonic()
        self.ctx = gc.setup(a.device, a.backend, a.fake_hosts)
        self.comm = None
        self.shapes = layout(a.params, a.segments)
        self.gen = torch.Generator(device=self.ctx.device)

    def params(self) -> List[torch.Tensor]:
        """Every rank starts from the same parameters (seeded; ScapeAdamS broadcasts anyway)."""
        g = torch.Generator(device=self.ctx.device)
        g.manual_seed(1)
        out = []
        for sh in self.shapes:
            p = torch.empty(sh, dtype=torch.float32, device=self.ctx.device)
            p.normal_(0.0, 0.02, generator=g)
            out.append(p.requires_grad_(True))
        return out

    def fill_grads(self, params: List[torch.Tensor], it: int) -> None:
        self.gen.manual_seed(1_000_003 * (self.ctx.rank + 1) + it)
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.normal_(0.0, 0.01, generator=self.gen)

    def check_memory(self) -> None:
        if self.ctx.device.type != "cuda":
            return
        free, total = torch.cuda.mem_get_info(self.ctx.device)
        need = BYTES_PER_PARAM * self.a.params * self.ctx.size + self.ctx.size * 1.5 * 2**30
        if need > free:
            raise SystemExit(f"--params {self.a.params}: ~{need / 2**30:.0f} GiB needed for "
                             f"{self.ctx.size} ranks, {free / 2**30:.0f} GiB of {total / 2**30:.0f}"
                             f" free (ask for an nvidia-h200 or fewer parameters)")

    # -- timing ----------------------------------------------------------------------------

    def timed(self, step_fn, params: List[torch.Tensor], after=None) -> Dict[str, Any]:
        a, ctx = self.a, self.ctx
        per_iter: List[float] = []
        extra: List[Dict[str, float]] = []
        for it in range(a.warmup + a.iters):
            self.fill_grads(params, it)
            gc.barrier(ctx)
            t0 = time.perf_counter()
            step_fn()
            gc.sync(ctx)
            dt = time.perf_counter() - t0
            slowest = max(gc.gather(ctx, dt))
            if it >= a.warmup:
                per_iter.append(slowest)
                if after is not None:
                    extra.append(after())
        return {"iter_ms": [1e3 * x for x in per_iter], "extra": extra}

    def identical(self, tensors: List[torch.Tensor]) -> bool:
        c = gc.device_checksum(tensors)
        every = gc.gather(self.ctx, c)
        return all(x == every[0] for x in every)

    # -- rows ------------------------------------------------------------------------------

    def row_scape(self, name: str, density: float, dense_all: bool, payload: str) -> Dict[str, Any]:
        from scape.optim import ScapeAdamS

        if self.comm is None:
            self.comm = gc.make_comm(self.ctx)
        params = self.params()
        kw: Dict[str, Any] = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                  max_grad_norm=CLIP, density=density, warmup_steps=0,
                                  payload_dtype=payload)
        if dense_all:
            kw["dense"] = lambda p: True
        opt = ScapeAdamS(params, self.comm, **kw)

        def after() -> Dict[str, float]:
            i = opt.info()[0]
            d = {f"phase_{k}": 1e3 * v for k, v in i.get("phase_seconds", {}).items()}
            d.update(bytes_sent=float(i["bytes_sent"]), mask_count=float(i.get("mask_count", 0)),
                     dense_count=float(i.get("dense_count", 0)))
            return d

        r = self.timed(opt.step, params, after)
        same = self.identical([p.detach() for p in params])
        state = opt.info()[0]
        opt.destroy()  # the buffers go with this frame
        rec = self.summarise(name, "ScapeAdamS", density, payload, r, same,
                             state_bytes=state.get("state_bytes"))
        rec["mask_state_bytes"] = state.get("mask_state_bytes")
        rec["scratch_bytes"] = state.get("scratch_bytes")
        return rec

    def row_adamw(self) -> Dict[str, Any]:
        import torch.distributed as dist

        ctx = self.ctx
        n = self.a.params
        flat = torch.empty(n, dtype=torch.float32, device=ctx.device)
        gflat = torch.zeros(n, dtype=torch.float32, device=ctx.device)
        src = self.params()
        params, a0 = [], 0
        for p0 in src:
            k = p0.numel()
            flat[a0:a0 + k].copy_(p0.detach().reshape(-1))
            a0 += k
        del src
        # one parameter tensor (the flat buffer): the fused AdamW makes one pass over it
        p = flat.requires_grad_(True)
        p.grad = gflat
        params = [p]
        kw: Dict[str, Any] = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        opt = None
        if ctx.device.type == "cuda":
            try:
                opt = torch.optim.AdamW(params, fused=True, **kw)
            except (TypeError, RuntimeError, ValueError):
                opt = None
        fused = opt is not None
        if opt is None:
            opt = torch.optim.AdamW(params, **kw)
        ex: List[float] = []

        def step() -> None:
            gc.sync(ctx)
            t0 = time.perf_counter()
            dist.all_reduce(gflat)  # the default group: NCCL on a GPU
            gflat.div_(ctx.size)
            gc.sync(ctx)
            ex.append(time.perf_counter() - t0)
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()

        def after() -> Dict[str, float]:
            return {"phase_exchange": 1e3 * ex[-1],
                    "bytes_sent": 2.0 * (ctx.size - 1) / ctx.size * 4 * n}

        r = self.timed(step, params, after)
        same = self.identical([flat.detach()])
        return self.summarise("adamw-nccl" if ctx.device.type == "cuda" else "adamw-gloo",
                              "torch AdamW" + (" (fused)" if fused else ""), 1.0, "float32", r,
                              same, state_bytes=8 * n)

    def summarise(self, name: str, optimizer: str, density: float, payload: str,
                  r: Dict[str, Any], same: bool, state_bytes: Optional[int]) -> Dict[str, Any]:
        ex = r["extra"]
        keys = sorted({k for e in ex for k in e})
        mean = {k: sum(e.get(k, 0.0) for e in ex) / max(1, len(ex)) for k in keys}
        mem = None
        if self.ctx.device.type == "cuda":
            mem = max(gc.gather(self.ctx, torch.cuda.max_memory_allocated(self.ctx.device)))
        return {
            "row": name, "optimizer": optimizer, "density": density, "payload": payload,
            "params": self.a.params, "segments": len(self.shapes), "ranks": self.ctx.size,
            "warmup": self.a.warmup, "iters": self.a.iters,
            "step_ms_median": gc.median(r["iter_ms"]), "step_ms": r["iter_ms"],
            "phases_ms": {k[6:]: v for k, v in mean.items() if k.startswith("phase_")},
            "bytes_sent_per_step": mean.get("bytes_sent"),
            "bytes_kind": "ring estimate 2(P-1)/P x 4 B" if optimizer.startswith("torch")
            else "measured (ScapeAdamS.info)",
            "mask_count": mean.get("mask_count"), "dense_count": mean.get("dense_count"),
            "state_bytes": state_bytes, "max_memory_allocated": mem,
            "ranks_identical": same,
        }

    def main(self) -> int:
        a, ctx = self.a, self.ctx
        self.check_memory()
        order = [x.strip() for x in a.rows.split(",") if x.strip()]
        est_ms: Optional[float] = None
        ok = True
        for row in order:
            left = a.deadline_s - (time.monotonic() - self.t_start) if a.deadline_s else None
            if left is not None and est_ms is not None:
                # a row costs about (warmup + iters) steps; scape-1 costs ~3x a dense step
                need = (a.warmup + a.iters) * est_ms / 1e3 * (3 if row == "scape-1" else 1) + 10
                go = gc.allsum(ctx, [1.0 if need < left else 0.0])[0] == ctx.size
                if not go:
                    rec = {"row": row, "skipped": f"time budget ({left:.0f} s left, ~{need:.0f} "
                                                  f"s needed)", "params": a.params}
                    if ctx.rank == 0:
                        gc.write_jsonl(os.path.join(a.out, "step_bench.jsonl"), rec)
                        print(f"[step] {row}: skipped ({rec['skipped']})", flush=True)
                    continue
            if ctx.device.type == "cuda":  # the last row's buffers are gone: a fresh peak
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(ctx.device)
            t0 = time.monotonic()
            if row == "adams-dense":
                rec = self.row_scape(row, 1.0, True, "float32")
            elif row == "adamw":
                rec = self.row_adamw()
            elif row.startswith("scape-"):
                rec = self.row_scape(row, float(row[6:]), False, a.payload)
            else:
                raise SystemExit(f"--rows: unknown row {row!r}")
            rec["wall_seconds"] = time.monotonic() - t0
            rec["env"] = gc.env_facts(ctx)
            if est_ms is None and rec.get("step_ms_median"):
                est_ms = max(rec["step_ms_median"], 1.0)
            ok = ok and rec["ranks_identical"]
            if ctx.rank == 0:
                gc.write_jsonl(os.path.join(a.out, "step_bench.jsonl"), rec)
                ph = ", ".join(f"{k} {v:.1f}" for k, v in rec["phases_ms"].items())
                print(f"[step] {rec['row']}: {rec['step_ms_median']:.2f} ms "
                      f"(bytes {rec['bytes_sent_per_step'] or 0:.0f}; {ph}) identical "
                      f"{rec['ranks_identical']}", flush=True)
        if self.comm is not None:
            self.comm.destroy()
        import torch.distributed as dist

        dist.destroy_process_group()
        return 0 if ok else 3


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backend", choices=("nccl", "ucx"), default="nccl")
    ap.add_argument("--fake-hosts", action="store_true",
                    help="a distinct NCCL_HOSTID per rank (NCCL through the net plugin)")
    ap.add_argument("--params", type=int, default=256 * 2**20)
    ap.add_argument("--segments", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--payload", default="bfloat16", help="the SCAPE rows' payload dtype")
    ap.add_argument("--rows", default="adams-dense,scape-0.01,scape-0.1,adamw,scape-1",
                    help="in this order (the first ones matter most under a time budget)")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="skip rows that would not end within this many seconds")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.warmup < 2:
        ap.error("--warmup must be >= 2 (step 0 is always dense)")
    if a.iters < 1:
        ap.error("--iters must be >= 1")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        return Bench(a).main()
    except SystemExit:
        raise
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        return 1


if __name__ == "__main__":
    sys.exit(main())
