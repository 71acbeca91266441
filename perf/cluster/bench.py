"""One rank of the emulated-cluster benchmark (issue 34): the quality study's own training step
(perf/train/scaling.py, Study.run, unchanged) timed from outside.

perf/cluster/cluster.py starts P of these, each in its own network and UTS namespace. Each runs
the methods given by --methods one after the other, every one a scaling.Run of --steps (the
first --warmup of them not timed) through Study.run, and appends one JSON line per method to
--out (rank 0). The step is not copied here: the timers are wrappers around what Study.run calls

  data.Batches.next       a step starts (wall clock, and the veth's byte counters from sysfs)
  GPT.forward, Tensor.backward        compute (forward + backward; the PowerSGD hook's
                                      all-reduces, which run inside backward, subtracted)
  Study.dist.all_reduce   dense AdamW's exchange (gloo)
  serial_powersgd_hook    PowerSGD's exchange (inside backward)
  ScapeAdamS.step / info  AdamS / SCAPE: the step; its phase_seconds split it into exchange
                          (exchange + gather), exposed mask sync (sync_wait) and the rest

so a step's time = compute + exchange + sync_wait + optimizer + other (Python around them).
After each SCAPE run it also times, on the same links, a blocking all-gather of the mask bytes
the run's mask sync sent and an 8-byte all-gather (the non-finite agreement that shares the
sync_wait phase): the hidden fraction of the sync is 1 - (sync_wait - agreement) / blocking sync.

    python3 perf/cluster/bench.py --methods adamw adams scape-0.1 scape-0.01 powersgd \\
        --size d128L4 --batch 12 --steps 14 --warmup 4 --iface eth0 --out results.jsonl
    python3 perf/cluster/bench.py --self-test      # plumbing, one process, no network
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(os.path.dirname(HERE), "train")
sys.path.insert(0, TRAIN)

import data  # noqa: E402
import model as gpt  # noqa: E402
import scaling  # noqa: E402  (the quality study: Study, Run, CONFIGS, match_powersgd_rank)
from scape.optim import ScapeAdamS  # noqa: E402

METHODS = ["adamw", "adams", "scape-0.1", "scape-0.01", "powersgd"]
# Not in the default runs: SCAPE 0.01 with an 8-bit payload (issue 33), by --methods.
EXTRA_METHODS = ["scape-0.01-e4m3"]
LR = {"adamw": 4e-3, "adams": 1e-3, "scape-0.1": 2e-3, "scape-0.01": 8e-3, "powersgd": 4e-3,
      "scape-0.01-e4m3": 8e-3}


class Timers:
    """What the wrappers record, per step of the current run."""

    def __init__(self, iface: str) -> None:
        self.iface = iface
        self.reset()

    def reset(self) -> None:
        self.starts: List[float] = []          # wall clock at each Batches.next
        self.tx: List[int] = []                # veth counters at each Batches.next
        self.rx: List[int] = []
        self.fwd: List[float] = []
        self.bwd: List[float] = []
        self.xchg: List[float] = []
        self.opt_step: List[float] = []
        self.ready: List[float] = []           # first communication call of each step
        self.phases: List[Dict[str, float]] = []
        self.mask_wait: List[float] = []  # per step: time blocked on the mask sync
        self.lib_bytes: List[Dict[str, Any]] = []
        self.end: Optional[float] = None
        self.end_tx = self.end_rx = 0

    def counters(self) -> tuple:
        if not self.iface:
            return 0, 0
        base = f"/sys/class/net/{self.iface}/statistics/"
        with open(base + "tx_bytes") as f:
            tx = int(f.read())
        with open(base + "rx_bytes") as f:
            rx = int(f.read())
        return tx, rx

    def step(self) -> int:
        return len(self.starts) - 1

    def mark_ready(self, t: float) -> None:
        """This rank has computed its gradients and makes its first exchange call."""
        i = self.step()
        if i >= 0 and len(self.ready) == i:
            self.ready.append(t)

    def add(self, arr: List[float], dt: float) -> None:
        i = self.step()
        while len(arr) <= i:
            arr.append(0.0)
        arr[i] += dt


T = Timers("")


def install(study: "scaling.Study") -> None:
    """Wraps what Study.run calls; every wrapper calls the original."""
    nxt = data.Batches.next

    def batches_next(self):  # type: ignore[no-untyped-def]
        tx, rx = T.counters()
        T.tx.append(tx)
        T.rx.append(rx)
        T.starts.append(time.perf_counter())
        return nxt(self)

    data.Batches.next = batches_next

    fwd = gpt.GPT.forward

    def gpt_forward(self, *a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = fwd(self, *a, **k)
        if self.training and T.starts:
            T.add(T.fwd, time.perf_counter() - t)
        return out

    gpt.GPT.forward = gpt_forward

    bwd = torch.Tensor.backward

    def tensor_backward(self, *a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = bwd(self, *a, **k)
        if T.starts:
            T.add(T.bwd, time.perf_counter() - t)
        return out

    torch.Tensor.backward = tensor_backward

    hook = scaling.serial_powersgd_hook

    def psgd_hook(state, bucket):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        T.mark_ready(t)
        fut = hook(state, bucket)
        T.add(T.xchg, time.perf_counter() - t)
        return fut

    scaling.serial_powersgd_hook = psgd_hook

    class Dist:
        """study.dist with a timed all_reduce (dense AdamW's gradient exchange)."""

        def __init__(self, d: Any) -> None:
            self._d = d

        def __getattr__(self, name: str) -> Any:
            return getattr(self._d, name)

        def all_reduce(self, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            T.mark_ready(t)
            out = self._d.all_reduce(*a, **k)
            T.add(T.xchg, time.perf_counter() - t)
            return out

    study.dist = Dist(study.dist)

    step = ScapeAdamS.step

    def opt_step(self, *a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        T.mark_ready(t)
        out = step(self, *a, **k)
        T.add(T.opt_step, time.perf_counter() - t)
        infos = self.info()
        ph: Dict[str, float] = {}
        for inf in infos:
            for kk, v in inf["phase_seconds"].items():
                ph[kk] = ph.get(kk, 0.0) + v
        # the part of sync_wait spent blocked on the mask sync
        T.mask_wait.append(sum(inf["mask_wait_seconds"] for inf in infos))
        T.phases.append(ph)
        T.lib_bytes.append({kk: sum(int(inf[kk]) for inf in infos)
                            for kk in ("bytes_sent", "mask_bytes", "payload_bytes",
                                       "dense_bytes", "control_bytes")})
        return out

    ScapeAdamS.step = opt_step

    ev = study.evaluate

    def evaluate(m, windows):  # type: ignore[no-untyped-def]
        if T.starts and T.end is None:  # the final evaluation: the last step ended
            T.end = time.perf_counter()
            T.end_tx, T.end_rx = T.counters()
        return ev(m, windows)

    study.evaluate = evaluate


def lateness(study: "scaling.Study") -> List[float]:
    """Per step, how long this rank waits for the slowest rank to reach its first exchange
    call: the ranks share one host's CLOCK_MONOTONIC (time.perf_counter), so the spread of
    their ready times is the load imbalance that the first collective of a step absorbs,
    whatever the network."""
    us = np.array([int(round(t * 1e6)) for t in T.ready], dtype=np.int64)
    n = allmax(study, [float(len(us))])[0]
    if len(us) != n or n == 0:
        return [0.0] * len(us)
    g = study.comm.all_gather(us).reshape(study.size, -1)
    return [float(v) * 1e-6 for v in (g.max(axis=0) - us)]


def summarize(res: Dict[str, Any], warmup: int, method: str, world: int,
              late: List[float]) -> Dict[str, Any]:
    """Per-step means over the timed steps (warm-up excluded) of this rank. The wait for
    slower ranks (`late`) is taken out of the first exchange phase of the step (SCAPE's
    sync_wait, then its exchange; the others' exchange) and reported on its own."""
    n = len(T.starts)
    ends = T.starts[1:] + [T.end]
    tx_end = T.tx[1:] + [T.end_tx]
    rx_end = T.rx[1:] + [T.end_rx]
    idx = list(range(warmup, n))

    def mean(arr: List[float]) -> float:
        return float(np.mean([arr[i] if i < len(arr) else 0.0 for i in idx])) if idx else 0.0

    step = [ends[i] - T.starts[i] for i in idx]
    fwd, bwd, xchg = mean(T.fwd), mean(T.bwd), mean(T.xchg)
    out: Dict[str, Any] = {
        "method": method, "steps_timed": len(idx), "warmup": warmup,
        "step_s": float(np.mean(step)), "step_s_median": float(np.median(step)),
        "step_s_all": step,
        "forward_s": fwd, "backward_s": bwd,
        "tx_bytes_per_step": float(np.mean([tx_end[i] - T.tx[i] for i in idx])),
        "rx_bytes_per_step": float(np.mean([rx_end[i] - T.rx[i] for i in idx])),
    }
    lt = [late[i] if i < len(late) else 0.0 for i in idx]
    wait = float(np.mean(lt)) if lt else 0.0
    if method == "powersgd":
        compute = fwd + bwd - xchg   # the hook runs inside backward
        exchange, sync, optim = xchg - wait, 0.0, None
    elif method == "adamw":
        compute, exchange, sync = fwd + bwd, xchg - wait, 0.0
        optim = None
    else:
        ph = [T.phases[i] for i in idx]
        sw = [p["sync_wait"] for p in ph]
        sync = float(np.mean([max(0.0, a - b) for a, b in zip(sw, lt)]))
        out["sync_wait_raw_s"] = float(np.mean(sw))
        exchange = float(np.mean([p["exchange"] + p["gather"] - max(0.0, b - a)
                                  for p, a, b in zip(ph, sw, lt)]))
        compute = fwd + bwd
        optim = mean(T.opt_step) - sync - exchange - wait
        lb = [T.lib_bytes[i] for i in idx]
        for k in lb[0]:
            out["lib_" + k + "_per_step"] = float(np.mean([b[k] for b in lb]))
        out["phase_seconds"] = {k: float(np.mean([p[k] for p in ph])) for k in ph[0]}
        out["mask_wait_s"] = float(np.mean([T.mask_wait[i] for i in idx]))
    if optim is None:  # torch's optimizer: the rest of the step after compute and exchange
        optim = out["step_s"] - compute - exchange - wait
        other = 0.0
    else:
        other = out["step_s"] - compute - exchange - sync - optim - wait
    out.update(compute_s=compute, exchange_s=exchange, sync_wait_s=sync, optimizer_s=optim,
               other_s=other, wait_slower_ranks_s=wait, late_s_all=lt)
    tps = res["batch"] * res["context"] * world
    out["tokens_per_step"] = tps
    out["tokens_per_second"] = tps / out["step_s"]
    out["loss_final_train"] = res["curve"][-1]["train_loss"]
    out["val_loss_final"] = res["final_val_loss"]
    out["ranks_identical"] = res["ranks_identical"]
    out["params"] = res["params"]
    out["lr"] = res["lr"]
    out["powersgd_rank"] = res.get("powersgd_rank", 0)
    out["bytes_per_step_study_estimate"] = res["bytes_per_step"]
    return out


def sync_probe(study: "scaling.Study", mask_bytes: float, reps: int) -> Dict[str, float]:
    """Blocking all-gathers on the same links: the mask sync's bytes (each rank's part
    mask_bytes / (P - 1), the ring volume being what info() reports), and 8 bytes."""
    comm, P = study.comm, study.size
    mask_bytes = allmax(study, [mask_bytes])[0]  # each rank's own part differs: the largest
    part = max(1, int(round(mask_bytes / max(1, P - 1) / 4)))  # int32 elements
    out = {}
    for name, size in (("mask_sync_blocking_s", part), ("agreement_s", 2)):
        buf = np.zeros(size, dtype=np.int32)
        comm.all_gather(buf)
        ts = []
        for _ in range(reps):
            comm.barrier()
            t = time.perf_counter()
            comm.all_gather(buf)
            ts.append(time.perf_counter() - t)
        out[name] = float(np.median(ts))
    return out


def allmax(study: "scaling.Study", vals: List[float]) -> List[float]:
    x = np.array(vals, dtype=np.float32)
    g = study.comm.all_gather(x).reshape(study.size, -1)
    return [float(v) for v in g.max(axis=0)]


def make_run(method: str, a: argparse.Namespace, world: int, psgd_rank: int = 0,
             match: float = 0.0, pred: float = 0.0) -> "scaling.Run":
    total = a.steps + a.warmup
    if method == "powersgd":
        return scaling.Run(a.size, "powersgd@0.01", "powersgd", a.seed, total, LR[method], 0.01,
                           "peer", world, a.batch, powersgd_rank=psgd_rank, match_bytes=match,
                           powersgd_bytes_predicted=pred)
    c = scaling.CONFIGS[method]
    # SCAPE's density warm-up (a tenth of the steps) ends inside the untimed warm-up
    wf = scaling.DENSITY_WARMUP_FRAC if c["opt"] == "scape" else 0.0
    return scaling.Run(a.size, method, c["opt"], a.seed, total, LR[method], c["density"],
                       "cluster", world, a.batch, warmup_frac=wf, options=c.get("options", ""))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS + EXTRA_METHODS)
    ap.add_argument("--size", default="d128L4", choices=sorted(scaling.SIZES))
    ap.add_argument("--batch", type=int, default=12, help="sequences of 64 per rank per step")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps before them")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--iface", default="", help="the veth whose counters are read (eth0)")
    ap.add_argument("--out", default="", help="JSON lines (rank 0 appends)")
    ap.add_argument("--tag", default="", help="JSON object merged into every line")
    ap.add_argument("--probe-reps", type=int, default=5)
    ap.add_argument("--self-test", action="store_true",
                    help="one rank on loopback, 3 steps of every method (no namespaces)")
    a = ap.parse_args(argv)
    if a.self_test:
        a.size, a.batch, a.steps, a.warmup, a.probe_reps = "d16L1", 2, 2, 2, 1
        a.iface = a.iface or "lo"
    if a.warmup < 2:
        ap.error("--warmup >= 2 (PowerSGD's first two steps are dense all-reduces)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    T.iface = a.iface
    out_dir = os.path.dirname(os.path.abspath(a.out)) if a.out else "/tmp"
    # the study's own command line with its defaults (a hand-built Namespace missed every
    # option scaling.py gained later, and every cluster run then failed at start-up)
    sargs = scaling.arg_parser().parse_args(["--plan", "smoke",
                                             "--out", os.path.join(out_dir, "study")])
    study = scaling.Study(sargs)
    # one evaluation (before and after), few windows: the step loop is what is timed
    study.plan = scaling.Plan([a.size], 0.0, 64, a.batch, a.steps + a.warmup, 1, 1, 16, 64,
                              a.steps + a.warmup, {})
    install(study)
    tag = json.loads(a.tag) if a.tag else {}
    world = study.size
    shapes = scaling.param_shapes(a.size, 64)
    scape_001_bytes = 0.0
    ok = True
    for method in a.methods:
        kw: Dict[str, Any] = {}
        if method == "powersgd":
            # the matrix rank closest to SCAPE 0.01's steady-state bytes (as the study does)
            target = scape_001_bytes or scaling.ring_bytes(0.01 * sum(
                int(np.prod(s)) for s in shapes), world)
            r, pred = scaling.match_powersgd_rank(shapes, target, 10 ** 6, world)
            kw = dict(psgd_rank=r, match=target, pred=pred)
        run = make_run(method, a, world, **kw)
        T.reset()
        t0 = time.perf_counter()
        res = study.run(run)
        s = summarize(res, a.warmup, method, world, lateness(study))
        if method == "scape-0.01":
            scape_001_bytes = s["lib_bytes_sent_per_step"]
        if method.startswith("scape"):
            s.update(sync_probe(study, s["lib_mask_bytes_per_step"], a.probe_reps))
            # exposed: the time the step blocked on the mask sync (scapeOptimInfo_t's
            # maskWaitSeconds); beside it the 2026-12-06 runs' figure, the sync_wait phase less
            # the agreement (it also holds the non-finite scan and the advance)
            exposed_phase = max(0.0, s["sync_wait_s"] - s["agreement_s"])
            exposed = s["mask_wait_s"]
            blk = s["mask_sync_blocking_s"]
            s["sync_hidden_fraction"] = max(0.0, 1.0 - exposed / blk) if blk > 0 else None
            s["sync_hidden_fraction_phase"] = (max(0.0, 1.0 - exposed_phase / blk)
                                               if blk > 0 else None)
        # the slowest rank's step and the largest counters are the job's
        keys = ["step_s", "tx_bytes_per_step", "rx_bytes_per_step"]
        mx = allmax(study, [s[k] for k in keys])
        s["per_rank0"] = {k: s[k] for k in keys}
        for k, v in zip(keys, mx):
            s[k + "_max_over_ranks"] = v
        s["wall_s"] = time.perf_counter() - t0
        s.update(world_size=world, size=a.size, batch=a.batch, hostname=os.uname().nodename,
                 iface=a.iface, **tag)
        ok = ok and bool(s["ranks_identical"])
        if study.rank == 0:
            print(f"{method:11s} {s['tokens_per_second']:8.0f} tok/s  step {s['step_s']:.3f} s "
                  f"(compute {s['compute_s']:.3f} exchange {s['exchange_s']:.3f} sync "
                  f"{s['sync_wait_s']:.3f} optim {s['optimizer_s']:.3f} wait-for-ranks "
                  f"{s['wait_slower_ranks_s']:.3f})  wire "
                  f"{s['tx_bytes_per_step']:,.0f} B/step  loss {s['loss_final_train']:.4f}",
                  flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(s) + "\n")
    study.dist.destroy_process_group()
    study.comm.destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
