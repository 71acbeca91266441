"""Runs an example script after importing a CPU-only patch module from this folder: the test
harness's way to apply the small patches an old framework needs on this machine (Debian's
torch 1.13 on CPU, Python 3.11), so that neither the example nor scape.integrations carries
them. On a GPU cluster with current versions the example runs as it is.

    python -m scape.launch -n 2 tests/python/frameworks/run_patched.py PATCHES SCRIPT [ARGS...]

PATCHES names a module here (``cpu_patches_deepspeed``, ...); its import applies the patches.
"""
from __future__ import annotations

import importlib
import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: run_patched.py PATCH_MODULE SCRIPT [ARGS...]")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    importlib.import_module(sys.argv[1])
    script = sys.argv[2]
    sys.argv = [script] + sys.argv[3:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
