"""The CI smoke of the training experiment: 2 ranks launched from RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT (scape.launch) train the byte-level GPT of perf/train with
ScapeAdamS at density 0.1 for 40 steps. Asserts that the validation loss falls, that the
parameter hashes of the ranks agree at every evaluation, and that the binding's errors
surface as exceptions (perf/train/train.py --plan smoke checks those on every rank)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unittest

from _harness import HERE, PYTHON

ROOT = os.path.dirname(os.path.dirname(HERE))


class Smoke(unittest.TestCase):
    def test_two_rank_training_smoke(self):
        with tempfile.TemporaryDirectory(prefix="scape_smoke_") as out:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
            env.setdefault("SCAPE_TIMEOUT_MS", "20000")
            env["OMP_NUM_THREADS"] = "1"
            p = subprocess.run([PYTHON, "-m", "scape.launch", "-n", "2", "--timeout", "100",
                                os.path.join(ROOT, "perf", "train", "train.py"), "--plan",
                                "smoke", "--out", out],
                               env=env, capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
            with open(os.path.join(out, "runs.jsonl")) as f:
                runs = [json.loads(line) for line in f if line.strip()]
            self.assertEqual(len(runs), 1)
            curve = runs[0]["curve"]
            self.assertGreaterEqual(len(curve), 3)
            self.assertLess(curve[-1]["val_loss"], curve[0]["val_loss"] - 0.5,
                            [c["val_loss"] for c in curve])
            self.assertTrue(all(c["identical"] for c in curve), "ranks diverged")
            self.assertLess(runs[0]["avg_density"], 1.0)  # the sparse path really ran
            for r in range(2):
                with open(os.path.join(out, f"smoke_errors.rank{r}.json")) as f:
                    e = json.load(f)
                self.assertTrue(e["ok"], e)
                self.assertEqual(e["seen"]["noncontiguous"][1], "send")
                self.assertIn("scapeOptimCreate", e["seen"]["layout"][1])


if __name__ == "__main__":
    unittest.main()
