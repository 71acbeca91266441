"""Runs a test case on several real processes that meet over the library's bootstrap on
loopback, as users launch them (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT).

Each rank runs ``tests/python/rank_worker.py CASE OUTDIR [ARGS]`` and writes its result as JSON
to OUTDIR/rank<r>.json; the parent collects them. Every run has a deadline: the ranks are
killed when it passes, and the library's own timeout (SCAPE_TIMEOUT_MS, set short here) fires
well before it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

sys.path.insert(0, HERE)


def _launch():
    import scape.launch

    return scape.launch


class RankFailure(AssertionError):
    pass


def run_ranks(case: str, nranks: int, *args: Any, timeout: float = 90.0,
              env: Optional[Dict[str, str]] = None, expect_fail: bool = False,
              lib_timeout_ms: int = 15000) -> List[Dict[str, Any]]:
    """Runs `case` on `nranks` processes; returns each rank's JSON result (rank order).
    Raises RankFailure with the ranks' output when one exits non-zero (unless expect_fail)."""
    launch = _launch()
    with tempfile.TemporaryDirectory(prefix="scape_py_") as out:
        e = dict(os.environ)
        e.setdefault("SCAPE_TIMEOUT_MS", str(lib_timeout_ms))
        e["SCAPE_SOCKET_IFNAME"] = "lo"
        e["OMP_NUM_THREADS"] = "1"
        e["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        if env:
            e.update(env)
        logs = [open(os.path.join(out, f"log{r}.txt"), "w+") for r in range(nranks)]
        cmd = [PYTHON, os.path.join(HERE, "rank_worker.py"), case, out] + [str(a) for a in args]
        port = launch.free_port_pair()
        procs = []
        for r in range(nranks):
            procs.append(subprocess.Popen(cmd, env=launch.rank_env(r, nranks, port, e),
                                          stdout=logs[r], stderr=subprocess.STDOUT))
        codes = []
        try:
            for p in procs:
                try:
                    codes.append(p.wait(timeout=timeout))
                except subprocess.TimeoutExpired:
                    codes.append(None)
                    timeout = 1  # the others have had their time too
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        texts = []
        for f in logs:
            f.seek(0)
            texts.append(f.read())
            f.close()
        results = []
        for r in range(nranks):
            path = os.path.join(out, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
            else:
                results.append({"_missing": True})
        hung = [r for r, c in enumerate(codes) if c is None]
        if hung:
            raise RankFailure(f"{case}: ranks {hung} did not finish within the deadline\n" +
                              _fmt(texts))
        if not expect_fail and any(c != 0 for c in codes):
            raise RankFailure(f"{case}: exit codes {codes}\n" + _fmt(texts))
        for r, res in enumerate(results):
            res["_exit"] = codes[r]
            res["_log"] = texts[r]
        return results


def _fmt(texts: Sequence[str]) -> str:
    return "\n".join(f"--- rank {r} ---\n{t[-4000:]}" for r, t in enumerate(texts))
