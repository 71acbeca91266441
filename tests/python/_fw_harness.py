"""What the framework tests (test_fw_deepspeed / _megatron / _lightning) share: the frameworks
venv's python (tests/install_frameworks.sh), the environment its ranks run in, and a 2-rank
launch of an example through tests/python/frameworks/run_patched.py with the harness's
CPU-only patch module for that framework."""
from __future__ import annotations

import os
import subprocess
from typing import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PATCHED = os.path.join(HERE, "frameworks", "run_patched.py")
FW_PYTHON = (os.environ.get("SCAPE_FRAMEWORKS_PYTHON")
             or os.path.expanduser("~/.cache/scape/frameworks-venv/bin/python"))
INSTALL = "run bash tests/install_frameworks.sh (or set SCAPE_FRAMEWORKS_PYTHON)"


def example_path(name: str) -> str:
    return os.path.join(ROOT, "examples", name)


def fw_env() -> dict:
    """The ranks' environment: the `scape` package this test imports alone on PYTHONPATH (the
    venv's own pins must stay ahead of Debian's site-packages), loopback, one thread."""
    import scape

    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(scape.__file__)))
    env.setdefault("SCAPE_TIMEOUT_MS", "30000")
    env["OMP_NUM_THREADS"] = "1"
    env["SCAPE_SOCKET_IFNAME"] = "lo"
    env["UCX_NET_DEVICES"] = "lo"
    return env


def require(module: str) -> str:
    """The version of `module` in the frameworks venv; AssertionError saying how to install
    it when the venv or the module is missing."""
    if not os.path.exists(FW_PYTHON):
        raise AssertionError(f"the frameworks venv's python {FW_PYTHON} does not exist: "
                             f"{INSTALL}")
    p = subprocess.run([FW_PYTHON, "-c", f"import {module}, scape.optim; "
                        f"print({module}.__version__)"], env=fw_env(),
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise AssertionError(f"{FW_PYTHON} cannot import {module} and scape: {INSTALL}\n"
                             f"{p.stderr[-1500:]}")
    return p.stdout.strip()


def run_example(patches: str, example: str, args: Sequence[str],
                timeout: float = 150) -> subprocess.CompletedProcess:
    """examples/`example` on 2 ranks with the venv's python, after the patch module
    `patches` (tests/python/frameworks/); the launcher's own deadline is 10 s inside ours."""
    cmd = [FW_PYTHON, "-m", "scape.launch", "-n", "2", "--timeout", str(int(timeout - 10)),
           PATCHED, patches, example_path(example), *args]
    return subprocess.run(cmd, env=fw_env(), capture_output=True, text=True, timeout=timeout)
