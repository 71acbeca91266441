"""One configuration of the end-to-end training run of perf/gpu/gpu_train.sh, one process per rank
(``python3 -m scape.launch -n 4 perf/gpu/gpu_train.py --config scape-0.01 ...``).

A byte-level GPT (perf/train/model.py, imported, not copied) on the fortune databases of
Debian's `fortunes` package (perf/train/data.py's documents, split and shards), data-parallel
over the ranks, the same seed and token budget for every configuration:

  adamw            torch.optim.AdamW under torch DistributedDataParallel (NCCL on a GPU, gloo
                   on the CPU); with a 16-bit model, fp32 master weights kept here (the 16-bit
                   gradients DDP averaged are copied to the masters, clipped, AdamW updates the
                   masters, the model gets them rounded)
  adams            dense AdamS through the library: scape.optim.ScapeAdamS with every tensor
                   dense (dense=lambda p: True; no top-k, every value exchanged), fp32 payload
  scape-<d>        SCAPE-AdamS at density d (geometric density warm-up over 10% of the steps),
                   bf16 payloads
  scape-<d>-<v>    the same with the options <v>, "+"-joined: segment_rms (entering, issue 23),
                   clipstay (clip_norm="staying"), artifact (bias_correction="artifact")

ScapeAdamS holds the fp32 master weights of a bf16 model itself (master_weights, auto).
Rank 0 appends one JSON line to OUT/train_runs.jsonl: the validation-loss curve (with the bytes
this rank had sent by each evaluation), tokens/s, step times with the library's phases
(ScapeAdamS.info()), bytes per step per rank, and at every evaluation the hash of the fp32
master weights and of the model's parameters on every rank (they must all agree).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# perf/train first: perf/model.py is another module of that name
sys.path.insert(0, os.path.join(HERE, "..", "train"))

import data  # noqa: E402  (perf/train/data.py)
import gpu_common as gc  # noqa: E402
import model as gpt  # noqa: E402  (perf/train/model.py)


@dataclass
class Shape:
    d_model: int
    n_layers: int
    n_heads: int
    context: int
    batch: int          # sequences per rank per step
    steps: int
    eval_every: int
    eval_windows: int   # validation windows, all ranks together


SHAPES = {
    # 25,482,752 parameters: 8 blocks of d_model 512 (12 d^2 each) + 257 x 512 tied embedding
    # and 256 x 512 positions; 16 x 256 tokens per rank per step, 200 steps: 3.3M tokens on 4
    # ranks (the fortunes' training text is 2.2M bytes: about 1.5 epochs).
    "gpu": Shape(512, 8, 8, 256, 16, 200, 40, 512),
    # 19,177,984 parameters: the same blocks, 6 of them; the length axis's model
    # (perf/gpu/gpu_length.py, which sets the steps and evaluations of each run)
    "len20": Shape(512, 6, 8, 256, 16, 200, 40, 512),
    # the CPU dry run: a few thousand parameters, a few steps
    "dry": Shape(32, 1, 2, 32, 4, 8, 4, 32),
}
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
CLIP = 1.0
LR_WARMUP_FRAC = 0.05   # linear lr warm-up, then cosine decay to 10% of the peak
DENSITY_WARMUP_FRAC = 0.1


def lr_at(step: int, steps: int, peak: float) -> float:
    w = max(1, int(LR_WARMUP_FRAC * steps))
    if step < w:
        return peak * (step + 1) / w
    t = (step - w) / max(1, steps - w)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def parse_config(name: str) -> Dict[str, Any]:
    """adamw | adams | scape-<density>[-<variant>]"""
    if name in ("adamw", "adams"):
        return {"name": name, "opt": name, "density": 1.0, "variant": None}
    parts = name.split("-", 2)
    if parts[0] != "scape" or len(parts) < 2:
        raise SystemExit(f"--config: {name!r} is not adamw, adams or scape-<density>[-<variant>]")
    try:
        d = float(parts[1])
    except ValueError:
        raise SystemExit(f"--config: bad density in {name!r}") from None
    if not 0.0 < d <= 1.0:
        raise SystemExit(f"--config: density {d} not in (0, 1]")
    return {"name": name, "opt": "scape", "density": d,
            "variant": parts[2] if len(parts) > 2 else None}


def load_corpus(corpus_dir: Optional[str]) -> data.Corpus:
    """data.load() (Debian's installed package), or the copy perf/gpu/gpu_train.sh bundled: the
    same files in the same order, so the same documents, split and shards."""
    if not corpus_dir:
        return data.load()
    with open(os.path.join(corpus_dir, "manifest.json")) as f:
        man = json.load(f)
    h = hashlib.sha256()
    docs: List[bytes] = []
    files = [os.path.join(corpus_dir, name) for name in man["files"]]
    for p in files:
        with open(p, "rb") as fh:
            text = fh.read()
        h.update(text)
        docs.extend(data.split_documents(text))
    if h.hexdigest() != man["sha256"]:
        raise SystemExit(f"{corpus_dir}: the files' sha256 {h.hexdigest()} is not the "
                         f"manifest's {man['sha256']}")
    train, val = [], []
    for i, d in enumerate(docs):
        (val if data.is_validation(i, 0.1) else train).append(d)
    return data.Corpus(man["package"], man["version"], files, h.hexdigest(), len(docs), train, val)


class Trainer:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.t_start = time.monotonic()
        self.ctx = gc.setup(a.device, a.backend, a.fake_hosts)
        self.cfg = parse_config(a.config)
        self.shape = SHAPES[a.shape]
        if a.steps:
            self.shape.steps = a.steps
        if a.eval_every:
            self.shape.eval_every = a.eval_every
        self.corpus = load_corpus(a.corpus)
        shard = data.rank_shard(self.corpus.train_docs, self.ctx.rank, self.ctx.size)
        self.train_stream = data.encode(shard)
        s = self.shape
        val = data.eval_windows(data.encode(self.corpus.val_docs), s.context, s.eval_windows)
        self.val = torch.from_numpy(val[self.ctx.rank::self.ctx.size]).to(self.ctx.device)

    # -- model and hashes ----------------------------------------------------------------

    def dtype(self) -> torch.dtype:
        want = self.a.dtype
        if want == "auto":  # the dry run: bf16 where it can run
            if self.cfg["opt"] == "adamw":
                # gloo (torch 1.13) has no bf16 all-reduce: fp32 on the CPU, with separate
                # fp32 masters all the same (--separate-masters), so their code runs
                return torch.bfloat16 if self.ctx.device.type == "cuda" else torch.float32
            return torch.bfloat16 if self.mixed_precision_available() else torch.float32
        return {"bfloat16": torch.bfloat16, "float32": torch.float32}[want]

    @staticmethod
    def mixed_precision_available() -> bool:
        from scape.optim import ScapeAdamS
        return gc.accepts(ScapeAdamS.__init__, "master_weights")

    @torch.no_grad()
    def evaluate(self, m: torch.nn.Module) -> float:
        m.eval()
        tot, cnt = 0.0, 0.0
        for i in range(0, len(self.val), 16):
            w = self.val[i:i + 16]
            tot += float(m(w[:, :-1], w[:, 1:]).float()) * len(w)
            cnt += len(w)
        m.train()
        tot, cnt = gc.allsum(self.ctx, [tot, cnt])
        return tot / cnt

    # -- one run ---------------------------------------------------------------------------

    def run(self, config: Optional[str] = None, steps: int = 0, eval_every: int = 0,
            lr: float = 0.0, deadline: Optional[float] = None,
            probe: Optional[Tuple[int, Callable[[Dict[str, Any]], bool]]] = None
            ) -> Optional[Dict[str, Any]]:
        """One training run: the configuration of --config and the shape's steps, or (several
        runs in one process: perf/gpu/gpu_length.py) `config`, `steps`, `eval_every`, the peak
        `lr` and an absolute time.monotonic() `deadline` of this run. With `probe` = (k, fn),
        fn gets the step and evaluation times after k steps (every rank, at the same step);
        False from it abandons the run (None is returned)."""
        if config is not None:
            self.cfg = parse_config(config)
        a, ctx, cfg = self.a, self.ctx, self.cfg
        s = replace(self.shape, steps=steps or self.shape.steps,
                    eval_every=eval_every or self.shape.eval_every)
        t_run = time.monotonic()
        comm_s = 0.0  # the communicator's start, when this run makes it (not the run's set-up)
        dtype = self.dtype()
        torch.manual_seed(a.seed)
        m = gpt.GPT(gpt.GPTConfig(vocab=data.VOCAB, context=s.context, d_model=s.d_model,
                                  n_layers=s.n_layers, n_heads=s.n_heads))
        m = m.to(device=ctx.device, dtype=dtype)
        params = list(m.parameters())
        n = sum(p.numel() for p in params)
        batches = data.Batches(self.train_stream, s.context, s.batch,
                               seed=a.seed * 1000 + ctx.rank)
        peak = lr or (a.lr_adamw if cfg["opt"] == "adamw" else a.lr_adams)
        master_hash_kind = ""
        ddp = None
        masters: List[torch.Tensor] = []
        if cfg["opt"] == "adamw":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ddp = DDP(m, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                      broadcast_buffers=False)
            if dtype != torch.float32 or a.separate_masters or a.dtype == "auto":
                masters = [p.detach().float().clone().requires_grad_(True) for p in params]
            else:
                masters = params
            kw: Dict[str, Any] = dict(lr=peak, betas=BETAS, eps=1e-8, weight_decay=WEIGHT_DECAY)
            opt: Any = None
            if ctx.device.type == "cuda":
                try:
                    opt = torch.optim.AdamW(masters, fused=True, **kw)
                except (TypeError, RuntimeError, ValueError):
                    opt = None
            if opt is None:
                opt = torch.optim.AdamW(masters, **kw)
            grad_bytes = torch.finfo(dtype).bits // 8
            ring_bytes = 2.0 * (ctx.size - 1) / ctx.size * grad_bytes * n
            master_hash_kind = "fp32 masters held here" if masters is not params else "params"
        else:
            from scape.optim import ScapeAdamS

            if dtype != torch.float32 and not self.mixed_precision_available():
                raise SystemExit("this scape's ScapeAdamS has no master_weights: a bf16 model "
                                 "needs the mixed-precision ScapeAdamS (helper optmp's change)")
            if getattr(self, "comm", None) is None:  # one communicator for every run
                comm_s = time.monotonic()
                self.comm = gc.make_comm(ctx)
                comm_s = time.monotonic() - comm_s
            kw = dict(lr=peak, betas=BETAS, eps=1e-8, weight_decay=WEIGHT_DECAY,
                      max_grad_norm=CLIP)
            if cfg["opt"] == "adams":
                kw.update(density=1.0, dense=lambda p: True, payload_dtype=torch.float32)
            else:
                kw.update(density=cfg["density"],
                          warmup_steps=int(DENSITY_WARMUP_FRAC * s.steps),
                          payload_dtype=torch.bfloat16)
                # the variant: "+"-joined options (issue 30): segment_rms (entering),
                # clipstay (clip_norm="staying"), artifact (bias_correction="artifact")
                opts = {"segment_rms": ("entering", "segment_rms"),
                        "clipstay": ("clip_norm", "staying"),
                        "artifact": ("bias_correction", "artifact")}
                for v in filter(None, (cfg["variant"] or "").split("+")):
                    if v not in opts:
                        raise SystemExit(f"unknown variant option {v!r} (one of {sorted(opts)})")
                    key, val = opts[v]
                    if not gc.accepts(ScapeAdamS.__init__, key):
                        raise SystemExit(f"this scape's ScapeAdamS has no {key}= (variant {v!r})")
                    kw[key] = val
            opt = ScapeAdamS(params, self.comm, **kw)
            ring_bytes = 0.0

        def hashes() -> Tuple[str, str]:
            model_h = gc.tensors_sha256(params)
            if cfg["opt"] == "adamw":
                return gc.tensors_sha256(masters), model_h
            nonlocal master_hash_kind
            try:
                h = opt.parameter_hash()
                master_hash_kind = "ScapeAdamS.parameter_hash()"
            except Exception as e:  # noqa: BLE001 - then our own over its flat buffers
                h = gc.tensors_sha256(opt.flat_parameters())
                master_hash_kind = f"sha256 of flat_parameters() ({type(e).__name__} from " \
                                   f"parameter_hash)"
            return h, model_h

        curve: List[Dict[str, Any]] = []
        step_s: List[float] = []
        sent: List[float] = []
        phases: Dict[str, float] = {}
        skipped = None
        bytes_cum = 0.0
        loss_val = float("nan")
        truncated = False
        if deadline is None and a.deadline_s:
            deadline = self.t_start + a.deadline_s
        last_eval_s = 0.0
        eval_s: List[float] = []
        setup_s = time.monotonic() - t_run - comm_s
        step = 0
        for step in range(s.steps + 1):
            if step % s.eval_every == 0 or step == s.steps:
                t_ev = time.monotonic()
                v = self.evaluate(m)
                mh, ph = hashes()
                every = gc.gather(ctx, (mh, ph))
                same = all(e == every[0] for e in every)
                curve.append({"step": step, "tokens": step * s.batch * s.context * ctx.size,
                              "bytes_sent": bytes_cum, "val_loss": v,
                              "train_loss": loss_val if step else None,
                              "master_hash": mh, "model_hash": ph, "identical": same})
                last_eval_s = time.monotonic() - t_ev
                eval_s.append(last_eval_s)
                if ctx.rank == 0:
                    print(f"[{cfg['name']}] step {step:4d}  val {v:.4f}  identical {same}  "
                          f"{(sum(step_s) / max(1, len(step_s))) * 1e3:.1f} ms/step", flush=True)
                if deadline is not None and step_s and step < s.steps:
                    # Stop early (and say so) rather than be killed with nothing written: the
                    # next evaluation period and the final evaluation must fit before the
                    # deadline. Every rank takes the same decision (any rank late: all stop).
                    mean_step = sum(step_s) / len(step_s)
                    late = time.monotonic() + s.eval_every * mean_step + 2 * last_eval_s + 5
                    truncated = gc.allsum(ctx, [1.0 if late > deadline else 0.0])[0] > 0
            if step == s.steps or truncated:
                break
            if probe is not None and step == probe[0] and \
                    not probe[1]({"step_s": list(step_s), "eval_s": list(eval_s),
                                  "setup_s": setup_s}):
                if hasattr(opt, "destroy"):
                    opt.destroy()
                return None
            for pg in opt.param_groups:
                pg["lr"] = lr_at(step, s.steps, peak)
            x, y = batches.next()
            xb = torch.from_numpy(x).to(ctx.device, non_blocking=True)
            yb = torch.from_numpy(y).to(ctx.device, non_blocking=True)
            gc.sync(ctx)
            t0 = time.perf_counter()
            if ddp is not None:
                m.zero_grad(set_to_none=True)
                loss = ddp(xb, yb)
                loss.backward()
                if masters is not params:
                    for mp, p in zip(masters, params):
                        mp.grad = p.grad.float()
                torch.nn.utils.clip_grad_norm_(masters, CLIP)
                opt.step()
                if masters is not params:
                    with torch.no_grad():
                        for mp, p in zip(masters, params):
                            p.copy_(mp)
                gc.sync(ctx)
                step_s.append(time.perf_counter() - t0)
                sent.append(ring_bytes)
            else:
                opt.zero_grad()
                loss = m(xb, yb)
                loss.backward()
                opt.step()
                gc.sync(ctx)
                step_s.append(time.perf_counter() - t0)
                info = opt.info()[0]
                sent.append(float(info["bytes_sent"]))
                for k, sec in info.get("phase_seconds", {}).items():
                    phases[k] = phases.get(k, 0.0) + sec
                skipped = info.get("skipped_steps", skipped)
            bytes_cum += sent[-1]
            loss_val = float(loss.float())
        steps_done = len(step_s)
        tokens = steps_done * s.batch * s.context * ctx.size
        train_s = sum(step_s)
        # the slowest rank's times decide the job's pace
        all_times = gc.gather(ctx, [train_s, gc.median(step_s) or 0.0])
        train_s_max = max(t[0] for t in all_times)
        rec = {
            "config": cfg["name"], "opt": cfg["opt"], "density": cfg["density"],
            "variant": cfg["variant"], "seed": a.seed, "shape": asdict(s), "params": n,
            "dtype": str(dtype).replace("torch.", ""),
            "master_weights": "fp32"
            if dtype != torch.float32 or (masters and masters is not params)
            else "none (fp32 model)",
            "payload": ("bf16 gradients (DDP)" if dtype == torch.bfloat16 else "fp32 (DDP)")
            if cfg["opt"] == "adamw" else ("float32" if cfg["opt"] == "adams" else "bfloat16"),
            "lr": peak, "betas": BETAS, "weight_decay": WEIGHT_DECAY, "clip": CLIP,
            "steps": s.steps, "steps_done": steps_done, "truncated": truncated,
            "tokens": tokens, "train_seconds_slowest_rank": train_s_max,
            "tokens_per_second": tokens / train_s_max if train_s_max else None,
            "step_ms_median": 1e3 * max(t[1] for t in all_times),
            "step_ms_mean": 1e3 * train_s / steps_done if steps_done else None,
            "phases_ms_mean": {k: 1e3 * v / steps_done for k, v in phases.items()}
            if steps_done else {},
            "bytes_per_step": float(np.mean(sent)) if sent else 0.0,
            "bytes_kind": "ring estimate 2(P-1)/P x grad bytes" if cfg["opt"] == "adamw"
            else "measured (ScapeAdamS.info: mask + payload + dense)",
            "skipped_steps": skipped, "final_val_loss": curve[-1]["val_loss"],
            "ranks_identical": all(c["identical"] for c in curve),
            "hash_kind": master_hash_kind, "curve": curve,
            "setup_seconds": setup_s, "comm_seconds": comm_s,
            "eval_seconds_mean": float(np.mean(eval_s)),
            "corpus": self.corpus.describe(), "env": gc.env_facts(ctx),
            "wall_seconds": time.monotonic() - self.t_start,
            "run_seconds": time.monotonic() - t_run,
        }
        if hasattr(opt, "destroy"):
            opt.destroy()
        return rec

    def main(self) -> int:
        rec = self.run()
        assert rec is not None
        if self.ctx.rank == 0:
            gc.write_jsonl(os.path.join(self.a.out, "train_runs.jsonl"), rec)
            print(f"[{rec['config']}] {rec['steps_done']} steps, val {rec['final_val_loss']:.4f}, "
                  f"{rec['tokens_per_second']:.0f} tok/s, {rec['step_ms_median']:.1f} ms/step, "
                  f"{rec['bytes_per_step']:.0f} B/step, identical {rec['ranks_identical']}"
                  f"{' (TRUNCATED by the time budget)' if rec['truncated'] else ''}", flush=True)
        comm = getattr(self, "comm", None)
        if comm is not None:
            comm.destroy()
        import torch.distributed as dist

        dist.destroy_process_group()
        return 0 if rec["ranks_identical"] else 3


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="adamw | adams | scape-<d>[-<variant>]")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backend", choices=("nccl", "ucx"), default="nccl",
                    help="the SCAPE communicator's backend")
    ap.add_argument("--fake-hosts", action="store_true",
                    help="a distinct NCCL_HOSTID per rank (NCCL through the net plugin)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpu")
    ap.add_argument("--steps", type=int, default=0, help="override the shape's steps")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--dtype", choices=("bfloat16", "float32", "auto"), default="bfloat16")
    ap.add_argument("--separate-masters", action="store_true",
                    help="AdamW: fp32 master copies even of an fp32 model (auto with --dtype auto)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lr-adamw", type=float, default=1e-3)
    ap.add_argument("--lr-adams", type=float, default=1e-3, help="AdamS and SCAPE")
    ap.add_argument("--corpus", default="", help="a bundled corpus folder (manifest.json)")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="stop early (marked truncated) to end within this many seconds")
    ap.add_argument("--out", required=True)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    a = parser().parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        return Trainer(a).main()
    except SystemExit:
        raise
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        return 1


if __name__ == "__main__":
    sys.exit(main())
