"""The three framework routes of docs/frameworks.md section 7 run on 2 ranks (issue 32):
Hugging Face Trainer (ScapeTrainer: resume from Trainer's checkpoint bit-identical on both
ranks, no gradient all-reduce in a step), accelerate, and a plain loop without a torch process
group. Needs transformers and accelerate (pinned in tests/install_deps.sh)."""
from __future__ import annotations

import os
import subprocess
import sys
import unittest

from _harness import HERE, PYTHON

ROOT = os.path.dirname(os.path.dirname(HERE))


def run_example(name: str, *extra: str, timeout: float = 150) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("SCAPE_TIMEOUT_MS", "30000")
    env.setdefault("OMP_NUM_THREADS", "1")
    p = subprocess.run([PYTHON, "-m", "scape.launch", "-n", "2", "--timeout", str(timeout - 10),
                        os.path.join(ROOT, "examples", name), *extra], env=env,
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{name} exited {p.returncode}\n{p.stdout[-3000:]}"
                             f"\n{p.stderr[-3000:]}")
    return p.stdout


class Frameworks(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        p = subprocess.run([PYTHON, "-c", "import transformers, accelerate"],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise AssertionError("transformers / accelerate are not installed for "
                                 f"{PYTHON}: run tests/install_deps.sh\n{p.stderr[-800:]}")

    def test_hf_trainer_resume_is_bit_identical_and_no_gradient_allreduce(self):
        out = run_example("hf_trainer_scape.py", "--check-resume", "--steps", "16",
                          "--log-every", "4")
        self.assertIn("dense gradient all-reduces in a training step: 0 ", out)
        # nor the used-parameter map DDP sends with find_unused_parameters=True
        self.assertIn("gloo all-reduces in a training step: 0 ", out)
        self.assertIn("ranks identical: True", out)
        for r in (0, 1):
            self.assertIn(f"rank {r}: resume from checkpoint-8 bit-identical to the "
                          f"uninterrupted run: True", out)
        self.assertIn("resume bit-identical on every rank: True", out)

    def test_accelerate_loop(self):
        out = run_example("accelerate_scape.py", "--steps", "30")
        self.assertIn("dense gradient all-reduces: 0;", out)
        self.assertIn("ranks identical: True", out)

    def test_plain_loop_without_process_group(self):
        out = run_example("plain_loop_scape.py", "--steps", "30")
        self.assertIn("torch process group: none", out)
        self.assertIn("ranks identical: True", out)


if __name__ == "__main__":
    unittest.main()
