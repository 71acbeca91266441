"""A minimal local launcher: ``python3 -m scape.launch -n 4 train.py [args]``.

It starts `n` processes of the same command on this host with the variables torchrun sets
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT), so a
script that calls :meth:`scape.Communicator.from_env` runs unchanged under torchrun, under
this launcher, or under mpirun. MASTER_PORT is a free port whose successor (the SCAPE
rendezvous port, MASTER_PORT + 1) is free too. SCAPE_SOCKET_IFNAME defaults to "lo".

When a rank fails, the others get `--grace` seconds to notice (the library tells them) and
are then killed; a job that runs past `--timeout` seconds is killed. The exit status is the
first failing rank's (124 for a timeout), 0 when every rank succeeded.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p such that p and p + 1 are both free now (p for a torch store, p + 1 for the
    SCAPE rendezvous)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            p = s.getsockname()[1]
        if p >= 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind((host, p))
                b.bind((host, p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free pair of ports found")


def rank_env(rank: int, nranks: int, port: int, base: Optional[Dict[str, str]] = None,
             addr: str = "127.0.0.1") -> Dict[str, str]:
    """The environment torchrun gives rank `rank` of `nranks` on one host."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), WORLD_SIZE=str(nranks), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(nranks), MASTER_ADDR=addr, MASTER_PORT=str(port))
    env.setdefault("SCAPE_SOCKET_IFNAME", "lo")
    return env


def run(cmd: Sequence[str], nranks: int, *, timeout: float = 600.0, grace: float = 30.0,
        env: Optional[Dict[str, str]] = None, port: Optional[int] = None,
        stdout=None, stderr=None) -> List[int]:
    """Runs `cmd` as `nranks` local ranks and returns their exit codes (-9 for a rank that
    was killed, 124 for every rank still running at the timeout)."""
    port = port or free_port_pair()
    procs = [subprocess.Popen(list(cmd), env=rank_env(r, nranks, port, env), stdout=stdout,
                              stderr=stderr)
             for r in range(nranks)]
    codes: List[Optional[int]] = [None] * nranks
    deadline = time.monotonic() + timeout
    kill_at: Optional[float] = None
    while any(c is None for c in codes):
        for i, p in enumerate(procs):
            if codes[i] is None:
                c = p.poll()
                if c is not None:
                    codes[i] = c
                    if c != 0 and kill_at is None:
                        kill_at = time.monotonic() + grace
        now = time.monotonic()
        if now > deadline or (kill_at is not None and now > kill_at):
            for i, p in enumerate(procs):
                if codes[i] is None:
                    p.kill()
                    p.wait()
                    codes[i] = 124 if now > deadline else -signal.SIGKILL
            break
        time.sleep(0.05)
    return [int(c) for c in codes]  # type: ignore[arg-type]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scape.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--nproc", type=int, required=True, help="number of local ranks")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before killing all")
    ap.add_argument("--grace", type=float, default=30.0,
                    help="seconds the others get after a rank failed")
    ap.add_argument("--port", type=int, default=0, help="MASTER_PORT (default: a free one)")
    ap.add_argument("-m", dest="module", help="run a module (as python -m)")
    ap.add_argument("script", nargs="?", help="the script to run")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.nproc < 1:
        ap.error("--nproc must be >= 1")
    if a.module:
        cmd = [sys.executable, "-m", a.module] + ([a.script] if a.script else []) + a.args
    elif a.script:
        cmd = [sys.executable, a.script] + a.args
    else:
        ap.error("give a script or -m module")
    codes = run(cmd, a.nproc, timeout=a.timeout, grace=a.grace, port=a.port or None)
    bad = [(r, c) for r, c in enumerate(codes) if c != 0]
    if bad:
        sys.stderr.write("scape.launch: " + ", ".join(f"rank {r} exited {c}" for r, c in bad)
                         + "\n")
        return next((c for _, c in bad if c > 0), 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
