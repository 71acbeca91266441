"""The training-quality experiment: a small byte-level GPT decoder trained from scratch on the
fortune databases of Debian's `fortunes` package, by several data-parallel ranks, with

  adamw   torch.optim.AdamW, gradients averaged by a dense all-reduce (torch.distributed gloo)
  adams   dense AdamS through the library (scape.optim.ScapeAdamS, density 1)
  scape   SCAPE-AdamS at density 0.1 / 0.01 (geometric density warm-up from 1.0), fp32 or bf16
  topk    raw-gradient top-k (99%) with error feedback through scape's sparse all-reduce,
          the averaged sparse gradient fed to AdamW

One process per rank, launched the way users launch (rank and rendezvous from RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT):

    python3 -m scape.launch -n 4 perf/train/train.py --plan full --out perf/train/out
    torchrun --standalone --nproc-per-node 4 perf/train/train.py --plan full --out ...

Plans: `smoke` (the CI check: a few dozen steps, asserts that the loss falls and that ranks
stay bit-identical), `tiny` (every configuration for a handful of steps: checks the code
paths in a minute or two), `full` (the experiment; see perf/RESULTS_training.md). The runs of a
plan execute one after the other inside this one job; phase 1 sweeps the peak learning rate of
AdamW and dense AdamS, phase 2 runs SCAPE with AdamS's best value and top-k with AdamW's.
Rank 0 appends one JSON line per run to OUT/runs.jsonl and writes OUT/meta.json;
perf/train/summarize.py turns them into the plot and the table.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import data  # noqa: E402
import model as gpt  # noqa: E402
import scape  # noqa: E402
from scape.optim import ScapeAdamS  # noqa: E402


@dataclass
class Shape:
    """Model and batch shape of a plan."""
    d_model: int
    n_layers: int
    n_heads: int
    context: int
    batch: int            # sequences per rank per step
    eval_every: int
    eval_windows: int     # validation windows (all ranks together)


@dataclass
class Run:
    name: str
    opt: str                       # adamw | adams | scape | topk
    seed: int
    steps: int
    lr: Optional[float] = None     # None: the best of the base optimizer's sweep
    density: float = 1.0
    warmup_frac: float = 0.0       # density warm-up, fraction of the steps
    payload: str = "float32"
    phase: int = 2
    group: str = ""                # the configuration this run is a seed of


BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.01
CLIP = 1.0
LR_WARMUP_FRAC = 0.05   # linear lr warm-up, then cosine decay to 10% of the peak
LR_GRID = (1e-3, 3e-3, 1e-2)
# Whose phase-1 best learning rate a run without its own lr takes.
BASE_OPTIMIZER = {"adamw": "adamw", "adams": "adams", "scape": "adams", "topk": "adamw"}


def plan_runs(plan: str, seeds: int, n_steps: int) -> List[Run]:
    runs: List[Run] = []
    sd = list(range(1, seeds + 1))
    if plan == "smoke":
        return [Run("scape-0.1", "scape", 1, n_steps, lr=3e-3, density=0.1, warmup_frac=0.2,
                    group="scape-0.1")]
    n, n4 = n_steps, 4 * n_steps
    for base in ("adamw", "adams"):
        for lr in LR_GRID:
            for s in sd:
                runs.append(Run(f"{base}-lr{lr:g}", base, s, n, lr=lr, phase=1,
                                group=f"{base}-lr{lr:g}"))

    def add(group: str, opt: str, steps: int, **kw: Any) -> None:
        for s in sd:
            runs.append(Run(group, opt, s, steps, group=group, **kw))

    add("scape-0.1", "scape", n, density=0.1, warmup_frac=0.1)
    add("scape-0.01", "scape", n, density=0.01, warmup_frac=0.1)
    add("scape-0.01-bf16", "scape", n, density=0.01, warmup_frac=0.1, payload="bfloat16")
    add("topk-0.01", "topk", n, density=0.01)
    add("scape-0.01-wu0.3", "scape", n, density=0.01, warmup_frac=0.3)
    add("adams-4N", "adams", n4)
    add("scape-0.01-4N", "scape", n4, density=0.01, warmup_frac=0.1)
    add("scape-0.01-wu0.3-4N", "scape", n4, density=0.01, warmup_frac=0.3)
    return runs


PLANS = {
    # shape, steps N, seeds
    "smoke": (Shape(48, 1, 2, 32, 8, 10, 64), 40, 1),
    "tiny": (Shape(32, 1, 2, 32, 4, 4, 32), 4, 2),
    "full": (Shape(64, 2, 4, 64, 8, 30, 256), 150, 2),
}


def lr_at(step: int, steps: int, peak: float) -> float:
    w = max(1, int(LR_WARMUP_FRAC * steps))
    if step < w:
        return peak * (step + 1) / w
    t = (step - w) / max(1, steps - w)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def param_hash(m: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in m.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


class Job:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.comm = scape.Communicator.from_env()
        self.rank, self.size = self.comm.rank, self.comm.size
        self.shape, n_steps, seeds = PLANS[args.plan]
        if args.steps:
            n_steps = args.steps
        if args.seeds:
            seeds = args.seeds
        self.runs = plan_runs(args.plan, seeds, n_steps)
        if args.only:
            self.runs = [r for r in self.runs if r.group in args.only or r.opt in args.only]
        self.corpus = data.load()
        shard = data.rank_shard(self.corpus.train_docs, self.rank, self.size)
        self.train_stream = data.encode(shard)
        val = data.eval_windows(data.encode(self.corpus.val_docs), self.shape.context,
                                self.shape.eval_windows)
        self.val = torch.from_numpy(val[self.rank::self.size])
        self.pg = None
        if any(r.opt == "adamw" for r in self.runs):
            import torch.distributed as dist

            if not dist.is_gloo_available():
                raise RuntimeError("this torch has no gloo backend for the AdamW baseline")
            dist.init_process_group("gloo", rank=self.rank, world_size=self.size)
            self.pg = dist
        self.best: Dict[str, float] = {}
        self.results: List[Dict[str, Any]] = []

    # -- helpers ---------------------------------------------------------------------------

    def allsum(self, values: List[float]) -> List[float]:
        x = np.array(values, dtype=np.float32)
        self.comm.all_reduce(x, op="sum")
        return [float(v) for v in x]

    @torch.no_grad()
    def evaluate(self, m: torch.nn.Module) -> float:
        m.eval()
        tot, cnt = 0.0, 0.0
        for i in range(0, len(self.val), 16):
            w = self.val[i:i + 16]
            tot += float(m(w[:, :-1], w[:, 1:])) * len(w)
            cnt += len(w)
        m.train()
        tot, cnt = self.allsum([tot, cnt])
        return tot / cnt

    def hashes_identical(self, m: torch.nn.Module) -> bool:
        h = np.frombuffer(bytes.fromhex(param_hash(m)), dtype=np.int64).copy()
        allh = self.comm.all_gather(h).reshape(self.size, -1)
        return bool((allh == allh[0]).all())

    # -- one run ---------------------------------------------------------------------------

    def run(self, r: Run) -> Dict[str, Any]:
        s = self.shape
        # SCAPE and dense AdamS (the 4N runs) take AdamS's best value; top-k takes AdamW's.
        peak = r.lr if r.lr is not None else self.best[BASE_OPTIMIZER[r.opt]]
        torch.manual_seed(r.seed)
        m = gpt.GPT(gpt.GPTConfig(vocab=data.VOCAB, context=s.context, d_model=s.d_model,
                                  n_layers=s.n_layers, n_heads=s.n_heads))
        params = list(m.parameters())
        n = sum(p.numel() for p in params)
        batches = data.Batches(self.train_stream, s.context, s.batch,
                               seed=r.seed * 1000 + self.rank)
        opt: Any
        resid = None
        if r.opt in ("adams", "scape"):
            opt = ScapeAdamS(params, self.comm, lr=peak, betas=BETAS, eps=1e-8,
                             weight_decay=WEIGHT_DECAY, density=r.density,
                             warmup_steps=int(r.warmup_frac * r.steps), max_grad_norm=CLIP,
                             payload_dtype=r.payload)
        else:
            opt = torch.optim.AdamW(params, lr=peak, betas=BETAS, eps=1e-8,
                                    weight_decay=WEIGHT_DECAY)
            if r.opt == "topk":
                resid = torch.zeros(n)
                offs = np.cumsum([0] + [p.numel() for p in params])
                dense_seg = [p.dim() <= 1 for p in params]
        curve, sent, dens, frac, identical = [], [], [], [], []
        train_time = 0.0
        loss_val = float("nan")
        for step in range(r.steps + 1):
            if step % s.eval_every == 0 or step == r.steps:
                v = self.evaluate(m)
                same = self.hashes_identical(m)
                identical.append(same)
                curve.append({"step": step, "tokens": step * s.batch * s.context * self.size,
                              "val_loss": v, "train_loss": loss_val if step else None,
                              "identical": same})
            if step == r.steps:
                break
            t0 = time.perf_counter()
            lr = lr_at(step, r.steps, peak)
            for pg in opt.param_groups:
                pg["lr"] = lr
            x, y = batches.next()
            opt.zero_grad()
            loss = m(torch.from_numpy(x), torch.from_numpy(y))
            loss.backward()
            loss_val = float(loss)
            if r.opt in ("adams", "scape"):
                opt.step()
                info = opt.info()[0]
                sent.append(info["bytes_sent"])
                dens.append(info["density"])
                frac.append(info["mask_count"] / n)
            elif r.opt == "adamw":
                g = torch.cat([p.grad.reshape(-1) for p in params])
                self.pg.all_reduce(g)
                g /= self.size
                i = 0
                for p in params:
                    p.grad.copy_(g[i:i + p.numel()].view_as(p))
                    i += p.numel()
                torch.nn.utils.clip_grad_norm_(params, CLIP)
                opt.step()
                # ring volume of a dense fp32 all-reduce: 2 (P-1)/P * 4 bytes per element
                sent.append(2 * (self.size - 1) / self.size * 4 * n)
                dens.append(1.0)
                frac.append(1.0)
            else:  # topk with error feedback
                g = torch.cat([p.grad.reshape(-1) for p in params])
                resid += g
                idx = []
                for k, (a, b) in enumerate(zip(offs[:-1], offs[1:])):
                    if b == a:
                        continue
                    if dense_seg[k]:
                        idx.append(np.arange(a, b))
                        continue
                    kk = max(1, int(r.density * (b - a)))
                    top = torch.topk(resid[a:b].abs(), kk, sorted=False).indices.numpy()
                    idx.append(np.sort(top) + a)
                ii = np.concatenate(idx).astype(np.uint64)
                it = torch.from_numpy(ii.astype(np.int64))
                vals = resid[it].contiguous()
                resid[it] = 0.0
                res = self.comm.sparse_all_reduce(ii, vals, n, op="avg")
                gavg = torch.from_numpy(res.dense) if isinstance(res.dense, np.ndarray) \
                    else res.dense
                i = 0
                for p in params:
                    p.grad.copy_(gavg[i:i + p.numel()].view_as(p))
                    i += p.numel()
                torch.nn.utils.clip_grad_norm_(params, CLIP)
                opt.step()
                sent.append(res.bytes_sent)
                dens.append(r.density)
                frac.append(len(ii) / n)
            train_time += time.perf_counter() - t0
        tokens = r.steps * s.batch * s.context * self.size
        out = {
            **asdict(r), "lr": peak, "params": n, "world_size": self.size,
            "final_val_loss": curve[-1]["val_loss"], "curve": curve,
            "tokens": tokens, "train_seconds": train_time,
            "tokens_per_second": tokens / train_time if train_time else None,
            "bytes_per_step": float(np.mean(sent)) if sent else 0.0,
            "bytes_per_step_dense_fp32_ring": 2 * (self.size - 1) / self.size * 4 * n,
            # scheduled density of the sparse tensors, and the fraction of all parameters
            # exchanged (always-dense 1-D tensors included), averaged over the steps
            "avg_density": float(np.mean(dens)) if dens else 1.0,
            "avg_sent_fraction": float(np.mean(frac)) if frac else 1.0,
            "ranks_identical": all(identical),
            "final_param_hash": param_hash(m),
        }
        if isinstance(opt, ScapeAdamS):
            opt.destroy()
        return out

    def main(self) -> int:
        out_dir = self.args.out
        if self.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "meta.json"), "w") as f:
                json.dump(self.meta(), f, indent=1)
            open(os.path.join(out_dir, "runs.jsonl"), "w").close()
        t_job = time.perf_counter()
        for phase in (1, 2):
            for r in (x for x in self.runs if x.phase == phase):
                res = self.run(r)
                self.results.append(res)
                if self.rank == 0:
                    with open(os.path.join(out_dir, "runs.jsonl"), "a") as f:
                        f.write(json.dumps(res) + "\n")
                    print(f"[{time.perf_counter() - t_job:7.1f}s] {r.name} seed {r.seed}: "
                          f"val {res['final_val_loss']:.4f}  {res['tokens_per_second']:.0f} tok/s"
                          f"  {res['bytes_per_step']:.0f} B/step  density "
                          f"{res['avg_density']:.4f}  identical {res['ranks_identical']}",
                          flush=True)
            if phase == 1:
                self.pick_best()
        if self.rank == 0:
            with open(os.path.join(out_dir, "meta.json")) as f:
                meta = json.load(f)
            meta["best_lr"] = self.best
            meta["job_seconds"] = time.perf_counter() - t_job
            with open(os.path.join(out_dir, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1)
        ok = all(r["ranks_identical"] for r in self.results)
        if self.args.plan == "smoke":
            c = self.results[0]["curve"]
            if not c[-1]["val_loss"] < c[0]["val_loss"] - 0.05:
                print(f"smoke: validation loss did not fall: {c[0]['val_loss']:.4f} -> "
                      f"{c[-1]['val_loss']:.4f}", file=sys.stderr)
                ok = False
        if not ok:
            print("FAILED: ranks diverged or the loss did not fall", file=sys.stderr)
        if self.pg is not None:
            self.pg.destroy_process_group()
        if self.args.plan == "smoke":
            ok = self.smoke_errors(out_dir) and ok
            self.comm.abort()  # the layout mismatch above broke it on purpose
        else:
            self.comm.destroy()
        return 0 if ok else 1

    def smoke_errors(self, out_dir: str) -> bool:
        """The binding's errors surface as Python exceptions in a training job: a local
        argument error (the communicator stays usable), then ranks that disagree on the
        model's layout (the library's error, raised on every rank)."""
        seen: Dict[str, Any] = {}
        try:
            self.comm.all_reduce(torch.zeros(4, 4).t())
        except scape.InvalidArgumentError as e:
            seen["noncontiguous"] = [type(e).__name__, e.argument, str(e)]
        self.comm.barrier()  # still usable after a local argument error
        m = torch.nn.Linear(8, 8 + (self.rank == 0))
        try:
            ScapeAdamS(m.parameters(), self.comm, broadcast_parameters=False)
        except scape.ScapeError as e:
            seen["layout"] = [type(e).__name__, str(e)]
        ok = (seen.get("noncontiguous", [None, None])[1] == "send"
              and "scapeOptimCreate" in seen.get("layout", ["", ""])[1])
        with open(os.path.join(out_dir, f"smoke_errors.rank{self.rank}.json"), "w") as f:
            json.dump({"ok": ok, "seen": seen}, f)
        if not ok:
            print(f"smoke: errors did not surface as expected: {seen}", file=sys.stderr)
        return ok

    def pick_best(self) -> None:
        for base in ("adamw", "adams"):
            by_lr: Dict[float, List[float]] = {}
            for res in self.results:
                if res["opt"] == base and res["phase"] == 1:
                    by_lr.setdefault(res["lr"], []).append(res["final_val_loss"])
            if by_lr:
                self.best[base] = min(by_lr, key=lambda lr: (np.mean(by_lr[lr]), lr))
        for base in ("adamw", "adams"):  # no sweep ran (--only): the grid's middle value
            self.best.setdefault(base, LR_GRID[1])

    def meta(self) -> Dict[str, Any]:
        def sh(cmd: List[str]) -> str:
            try:
                return subprocess.run(cmd, capture_output=True, text=True, timeout=20,
                                      cwd=HERE).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                return ""

        cpu = ""
        for line in sh(["lscpu"]).splitlines():
            if line.startswith("Model name"):
                cpu = line.split(":", 1)[1].strip()
        s = self.shape
        return {
            "plan": self.args.plan, "world_size": self.size, "corpus": self.corpus.describe(),
            "shape": asdict(s), "betas": BETAS, "weight_decay": WEIGHT_DECAY, "clip": CLIP,
            "lr_grid": LR_GRID, "lr_schedule": f"linear warm-up {LR_WARMUP_FRAC:g} of the steps, "
                                              f"cosine to 0.1 x peak",
            "machine": {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
                        "torch": torch.__version__, "numpy": np.__version__,
                        "scape_library": scape.library_path(), "scape_version": scape.version(),
                        "git": sh(["git", "rev-parse", "--short", "HEAD"]),
                        "blas": os.path.realpath("/usr/lib/x86_64-linux-gnu/libblas.so.3")},
            "dense_baseline": "torch.distributed gloo all_reduce (bytes: ring-volume estimate "
                              "2(P-1)/P x 4 B per parameter)",
            "runs": [asdict(r) for r in self.runs],
        }


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", choices=sorted(PLANS), default="tiny")
    ap.add_argument("--out", default=os.path.join(HERE, "out"))
    ap.add_argument("--steps", type=int, default=0, help="override N (steps of a short run)")
    ap.add_argument("--seeds", type=int, default=0, help="override the number of seeds")
    ap.add_argument("--only", nargs="*", help="run only these groups or optimizers")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return Job(args).main()


if __name__ == "__main__":
    sys.exit(main())
