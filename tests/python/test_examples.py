"""The worked example of docs/frameworks.md runs (2 ranks, replicated and sharded) and ends
with the loss down and the ranks bit-identical (the example exits non-zero otherwise)."""
from __future__ import annotations

import os
import subprocess
import sys
import unittest

from _harness import HERE, PYTHON

ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLE = os.path.join(ROOT, "examples", "megatron_style_scape.py")


class Examples(unittest.TestCase):
    def run_example(self, *extra: str) -> str:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("SCAPE_TIMEOUT_MS", "20000")
        p = subprocess.run([PYTHON, "-m", "scape.launch", "-n", "2", "--timeout", "100",
                            EXAMPLE, *extra], env=env, capture_output=True, text=True,
                           timeout=120)
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
        self.assertIn("ranks identical: True", p.stdout)
        return p.stdout

    def test_megatron_style_example_replicated(self):
        self.run_example()

    def test_megatron_style_example_sharded(self):
        self.run_example("--sharded", "--steps", "40")


if __name__ == "__main__":
    unittest.main()
