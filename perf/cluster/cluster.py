#!/usr/bin/env python3
"""The emulated bandwidth-bound cluster of issue 34 (run as root; perf/cluster/run.sh).

For each rank count P it builds P hosts (netns.py: own network and UTS namespaces, veths into a
bridge, tbf on both ends of every link), measures one step's compute on them (a short dense run
on unshaped links), and then, for each link setting, shapes every link and runs bench.py on
every host: the quality study's training (perf/train/scaling.py) for dense AdamW (torch,
gloo), dense AdamS (ScapeAdamS density=1), SCAPE 0.1 and 0.01 and PowerSGD (torch's hook, rank
matched to SCAPE 0.01's bytes). Link settings are named by their compute:network ratio
(dense all-reduce time / compute time): a setting of ratio R gets the rate at which this
machine's dense fp32 ring all-reduce of the model takes R x the measured compute.

    python3 perf/cluster/cluster.py --out perf/cluster/out            # the default (~30 min)
    python3 perf/cluster/cluster.py --quick --out /tmp/cl             # < 5 min
    python3 perf/cluster/cluster.py --self-test --out /tmp/cl         # no namespaces, no root

Every line of OUT/results.jsonl is one method at one (P, link setting); report.py turns OUT
into tables (with perf/model.py's prediction beside each measurement) and the plot.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import netns  # noqa: E402

# Named settings: compute:network ratios of real clusters (README.md gives the arithmetic).
NAMED = {"gh200-200g": 2.2, "h100-100gbe": 4.5}
SWEEP = {"r0.25": 0.25, "r1": 1.0, "r8": 8.0}   # + the named ones: 5 bandwidths
EXTRA = {"unshaped": 0.0, "r0.1": 0.1}          # no tbf, and ~400-700 Mbit/s: the crossover end
METHODS = ["adamw", "adams", "scape-0.1", "scape-0.01", "powersgd"]
EXTRA_METHODS = ["scape-0.01-e4m3"]  # by --methods only (bench.py says so too)


def ring_bytes(n: int, P: int) -> float:
    return 2.0 * (P - 1) / P * 4 * n


def pythonpath() -> str:
    cands = [os.environ.get("SCAPE_PYTHONPATH", ""), os.path.join(ROOT, "build", "python")]
    for c in cands:
        if c and os.path.isdir(os.path.join(c, "scape")):
            return c
    return ""


def rank_env(P: int, r: int, master: str, port: int, pypath: str) -> Dict[str, str]:
    # other SCAPE_* knobs of the caller's environment (SCAPE_CHUNK_BYTES, SCAPE_DEBUG ...) pass
    extra = {k: v for k, v in os.environ.items()
             if k.startswith("SCAPE_") and k not in ("SCAPE_PYTHONPATH", "SCAPE_PROGRESS")}
    return {**extra,
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": pypath, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        "RANK": str(r), "WORLD_SIZE": str(P), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": master, "MASTER_PORT": str(port),
        # the library's bootstrap and UCX, and gloo, all on the namespace's veth
        "SCAPE_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
        "UCX_NET_DEVICES": "eth0", "UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n",
        # every "host" believes it has the cores to itself; they share 2: do not spin
        "SCAPE_PROGRESS": os.environ.get("SCAPE_PROGRESS", "blocking"),
    }


class Runner:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out = os.path.abspath(a.out)
        os.makedirs(os.path.join(self.out, "logs"), exist_ok=True)
        self.pypath = pythonpath()
        self.port = 29500 + (os.getpid() % 200) * 20
        self.results = os.path.join(self.out, "results.jsonl")

    def launch(self, cl: "netns.Cluster", name: str, methods: List[str], steps: int,
               warmup: int, tag: Dict[str, Any]) -> bool:
        self.port += 2
        argv = [sys.executable, os.path.join(HERE, "bench.py"), "--methods", *methods,
                "--size", self.a.size, "--batch", str(self.a.batch), "--steps", str(steps),
                "--warmup", str(warmup), "--iface", "eth0", "--out",
                os.path.join(self.out, f"{name}.jsonl"), "--tag", json.dumps(tag)]
        procs = []
        for r in range(cl.P):
            env = rank_env(cl.P, r, cl.addr(0), self.port, self.pypath)
            log = open(os.path.join(self.out, "logs", f"{name}.r{r}.log"), "w")
            procs.append((subprocess.Popen(cl.cmd(r, argv, env), stdout=log,
                                           stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + self.a.timeout
        ok = True
        try:
            for p, log in procs:
                try:
                    ok = p.wait(timeout=max(1.0, deadline - time.monotonic())) == 0 and ok
                except subprocess.TimeoutExpired:
                    ok = False
                    break
        finally:
            for p, log in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                log.close()
        with open(os.path.join(self.out, "logs", f"{name}.r0.log")) as f:
            txt = f.read()
        print("\n".join("    " + ln for ln in txt.splitlines() if "tok/s" in ln), flush=True)
        if not ok:
            print(f"  {name}: a rank failed; see {self.out}/logs/{name}.r*.log", flush=True)
            print("\n".join(txt.splitlines()[-15:]), flush=True)
        return ok

    def run_p(self, P: int, settings: Dict[str, float]) -> bool:
        a = self.a
        ok = True
        with netns.Cluster(P) as cl:
            cl.shape(0, 0)
            print(f"P={P}: {P} hosts {', '.join(cl.addr(r) for r in range(P))} "
                  f"(namespaces {cl.ns[0]}..); calibrating compute on unshaped links",
                  flush=True)
            name = f"P{P}-calib"
            if os.path.exists(os.path.join(self.out, f"{name}.jsonl")):
                os.remove(os.path.join(self.out, f"{name}.jsonl"))
            if not self.launch(cl, name, ["adamw"], a.calib_steps, 3,
                               {"P": P, "link": "calib", "rate_mbit": 0}):
                return False
            with open(os.path.join(self.out, f"{name}.jsonl")) as f:
                cal = json.loads(f.readline())
            C, n = cal["compute_s"], cal["params"]
            dense = ring_bytes(n, P)
            print(f"P={P}: compute {C:.3f} s/step (forward+backward, this load), {n:,} params, "
                  f"dense ring all-reduce {dense / 1e6:.2f} MB sent per rank", flush=True)
            for link, ratio in sorted(settings.items(), key=lambda kv: kv[1]):
                # ratio 0: no tbf (the veths' own capacity, CPU-bound here)
                rate = dense * 8 / (ratio * C) / 1e6 if ratio > 0 else 0.0   # Mbit/s
                rate = float(f"{rate:.3g}")
                cl.shape(rate, a.delay_ms)
                print(f"P={P} {link}: ratio {ratio:g} -> {rate:g} Mbit/s per link "
                      f"({cl.note or f'delay {a.delay_ms} ms per link'})", flush=True)
                name = f"P{P}-{link}"
                out = os.path.join(self.out, f"{name}.jsonl")
                if os.path.exists(out):
                    os.remove(out)
                tag = {"P": P, "link": link, "ratio_target": ratio, "rate_mbit": rate,
                       "delay_ms": a.delay_ms if cl.netem else 0.0, "calib_compute_s": C,
                       "shaping_note": cl.note, "qdisc": cl.qdiscs()}
                t0 = time.monotonic()
                good = self.launch(cl, name, a.methods, a.steps, a.warmup, tag)
                ok = ok and good
                if os.path.exists(out):
                    with open(out) as f, open(self.results, "a") as g:
                        shutil.copyfileobj(f, g)
                print(f"P={P} {link}: {time.monotonic() - t0:.0f} s", flush=True)
        return ok


def machine_state() -> Dict[str, Any]:
    def rd(cmd: List[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"date": rd(["date", "-u", "+%Y-%m-%dT%H:%M:%SZ"]), "uptime": rd(["uptime"]),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("SCAPE_", "UCX_"))},
            "cores": os.cpu_count(), "kernel": rd(["uname", "-r"]),
            "git": rd(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"])}


def main(argv: List[str] = None) -> int:  # type: ignore[assignment]
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "out"))
    ap.add_argument("--quick", action="store_true",
                    help="P=2, the GH200 setting only, 4 timed steps (< 5 min)")
    ap.add_argument("--self-test", action="store_true",
                    help="the plumbing without namespaces or root: bench.py --self-test on "
                         "loopback (2 ranks) and report.py on its output")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--settings", nargs="+", default=None,
                    help="link settings (names of NAMED/SWEEP/EXTRA or NAME=RATIO, 0 = no tbf); "
                         "default: all seven at the smallest P, the two named ones at larger P")
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS + EXTRA_METHODS)
    ap.add_argument("--size", default="d128L4")
    ap.add_argument("--batch", type=int, default=24,
                    help="sequences of 64 per rank per step (24: compute >= 0.3 s on one core)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per method")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    ap.add_argument("--calib-steps", type=int, default=4)
    ap.add_argument("--delay-ms", type=float, default=0.05,
                    help="netem one-way delay per link, where the kernel has netem")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    ap.add_argument("--append", action="store_true",
                    help="add to OUT's results (another state-N.json) instead of starting over")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.self_test:
        pp = pythonpath()
        if not pp:
            print("SKIP: the library is not built (build/python/scape); see README.md")
            return 0
        res = os.path.join(a.out, "results.jsonl")
        if os.path.exists(res):
            os.remove(res)
        env = dict(os.environ, PYTHONPATH=pp, OMP_NUM_THREADS="1", SCAPE_PROGRESS="blocking")
        rc = subprocess.run([sys.executable, "-m", "scape.launch", "-n", "2", "--timeout",
                             "300", os.path.join(HERE, "bench.py"), "--self-test", "--out",
                             res, "--tag", json.dumps({"P": 2, "link": "self-test",
                                                       "ratio_target": 1.0, "rate_mbit": 0})],
                            env=env).returncode
        if rc:
            print(f"self-test: bench.py failed ({rc})")
            return 1
        with open(os.path.join(a.out, "state.json"), "w") as f:
            json.dump({**machine_state(), "mode": "self-test"}, f)
        rc = subprocess.run([sys.executable, os.path.join(HERE, "report.py"), a.out],
                            env=env).returncode
        print("self-test: " + ("passed" if rc == 0 else "report.py failed"))
        return rc
    if os.geteuid() != 0:
        print("SKIP: perf/cluster needs root (ip netns, tc); nothing was run")
        return 0
    for t in ("ip", "tc", "unshare"):
        if not shutil.which(t):
            print(f"SKIP: no '{t}' tool; nothing was run")
            return 0
    if not pythonpath():
        print("SKIP: the library is not built (build/python/scape): cmake -G Ninja -B build -S "
              ". -DSCAPE_WITH_CUDA=OFF && cmake --build build --target nccl-net-scape")
        return 0
    if a.quick:
        a.ranks, a.steps, a.warmup, a.calib_steps = [2], 4, 3, 3
        a.settings = a.settings or ["gh200-200g"]
    table = {**NAMED, **SWEEP, **EXTRA}

    def parse(names: List[str]) -> Dict[str, float]:
        out = {}
        for s in names:
            if "=" in s:
                k, v = s.split("=", 1)
                out[k] = float(v)
            else:
                out[s] = table[s]
        return out

    res = os.path.join(a.out, "results.jsonl")
    state = os.path.join(a.out, "state.json")
    if a.append and os.path.exists(state):
        k = 1
        while os.path.exists(os.path.join(a.out, f"state-{k}.json")):
            k += 1
        state = os.path.join(a.out, f"state-{k}.json")
    elif os.path.exists(res):
        os.remove(res)
    with open(state, "w") as f:
        json.dump({**machine_state(), "mode": "quick" if a.quick else "default",
                   "argv": sys.argv[1:]}, f)
    import signal

    def stop(sig: int, frame: Any) -> None:  # SIGTERM: unwind, so the namespaces go away
        raise SystemExit(f"cluster.py: signal {sig}")

    signal.signal(signal.SIGTERM, stop)
    r = Runner(a)
    ok = True
    t0 = time.monotonic()
    for P in a.ranks:
        if a.settings:
            settings = parse(a.settings)
        else:
            settings = dict(table) if P == min(a.ranks) else dict(NAMED)
        ok = r.run_p(P, settings) and ok
    print(f"all runs: {time.monotonic() - t0:.0f} s", flush=True)
    with open(state) as f:
        st = json.load(f)
    st["end"] = machine_state()
    with open(state, "w") as f:
        json.dump(st, f)
    # report.py imports the study's scaling.py, which imports scape: the library's package
    rc = subprocess.run([sys.executable, os.path.join(HERE, "report.py"), a.out],
                        env=dict(os.environ, PYTHONPATH=pythonpath())).returncode
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
