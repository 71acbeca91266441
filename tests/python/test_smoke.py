"""The CI smoke of the training experiment: 2 ranks launched from RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT (scape.launch) train the byte-level GPT of perf/train with
ScapeAdamS at density 0.1 for 40 steps. Asserts that the validation loss falls, that the
parameter hashes of the ranks agree at every evaluation, and that the binding's errors
surface as exceptions (perf/train/train.py --plan smoke checks those on every rank). Then the
scaling study's harness (perf/train/scaling.py --plan smoke: two tiny sizes, every
configuration, a few steps), resumed halfway, and its summary."""
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

    def test_scaling_study_smoke(self):
        """Every configuration of the scaling study runs, ranks stay identical, PowerSGD gets a
        matched rank, a second launch skips what runs.jsonl holds, the summary writes its
        tables and plots."""
        script = os.path.join(ROOT, "perf", "train", "scaling.py")
        with tempfile.TemporaryDirectory(prefix="scape_scaling_") as out:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
            env.setdefault("SCAPE_TIMEOUT_MS", "20000")
            env["OMP_NUM_THREADS"] = "1"

            def launch(*extra):
                p = subprocess.run([PYTHON, "-m", "scape.launch", "-n", "2", "--timeout", "100",
                                    script, "--plan", "smoke", "--out", out, *extra],
                                   env=env, capture_output=True, text=True, timeout=120)
                self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
                with open(os.path.join(out, "runs.jsonl")) as f:
                    return [json.loads(line) for line in f if line.strip()], p.stdout

            first, _ = launch("--sizes", "d16L1")
            runs, log = launch()
            self.assertEqual([r["key"] for r in runs[:len(first)]], [r["key"] for r in first])
            self.assertNotIn("d16L1 (", log)  # the first size was skipped, not run again
            keys = [r["key"] for r in runs]
            self.assertEqual(len(keys), len(set(keys)))
            groups = {(r["size"], r["group"]) for r in runs}
            want = ["adamw", "adams", "scape-0.1", "scape-0.01", "topk-0.1", "topk-0.01",
                    "powersgd@0.1", "powersgd@0.01"]
            sys.path.insert(0, os.path.dirname(script))
            try:
                import scaling
                if scaling.has_entering():
                    want += ["scape-0.1-segrms", "scape-0.01-segrms"]
            finally:
                sys.path.pop(0)
            for size in ("d16L1", "d24L1"):
                for g in want:
                    self.assertIn((size, g), groups)
            for r in runs:
                self.assertTrue(r["ranks_identical"], r["key"])
                self.assertTrue(all(c["identical"] for c in r["curve"]), r["key"])
                self.assertGreater(r["bytes_per_step"], 0, r["key"])
                if r["opt"] == "powersgd":
                    self.assertGreaterEqual(r["powersgd_rank"], 1)
                    self.assertGreater(r["match_bytes"], 0)
                if r["group"] == "scape-0.01":
                    self.assertLess(r["avg_sent_fraction"], 1.0)
            p = subprocess.run([PYTHON, os.path.join(ROOT, "perf", "train",
                                                     "scaling_summary.py"), out],
                               env=env, capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
            for f in ("scaling.md", "gap_vs_size.png", "loss_vs_bytes.png"):
                self.assertTrue(os.path.getsize(os.path.join(out, f)) > 0, f)


if __name__ == "__main__":
    unittest.main()
