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

    def test_quality_axes_schedule(self):
        """The quality study's axes (no ranks, no training): from a finished q20 sweep, q-len40
        runs every method's 3 seeds seed-major at q20's best lr, then the lr re-check (seed 1 at
        half and twice it), then the options the screen kept (3 seeds each at their method's
        lr); q-len10 has no re-check; q-size adds PowerSGD at AdamW's q20 lr, its rank matched
        to the size's SCAPE run; quality_summary's re-check table says
        whether the best lr moved."""
        sys.path.insert(0, os.path.join(ROOT, "perf", "train"))
        import quality_summary as qs
        import scaling as S

        best = {"adams": 1e-3, "scape-0.1": 4e-3, "scape-0.01": 8e-3, "adamw": 4e-3}
        q20 = S.Schedule(S.PLANS["q20"], 4, True)
        steps20 = q20.steps("d64L2")[0]
        rows = []
        for g, b in best.items():
            for lr in q20.sweep_lrs(rows, "d64L2", g):
                rows.append({"size": "d64L2", "size_label": "0.12M", "group": g,
                             "steps": steps20, "seed": 1, "lr": lr, "stage": "sweep",
                             "tokens_per_param": 20.0,
                             "final_val_loss": 2.0 + abs(S.math.log(lr / b))})
        for g, b in best.items():
            self.assertEqual(q20.best_lr(rows, "d64L2", g), b, g)
        axis = S.Schedule(S.PLANS["q-len40"], 4, True)
        todo, waiting = axis.runs(rows, "d64L2")
        self.assertEqual(waiting, [])
        got = [(r.group, r.seed, r.lr, r.stage) for r in todo]
        swept = ["adams", "scape-0.01", "scape-0.1"]
        want = [(g, s, best[g], "seed") for s in (1, 2, 3) for g in swept]
        want += [(g, 1, best[g] * f, "lrcheck") for f in (0.5, 2.0) for g in swept]
        want += [(g, s, best["scape-0.1"], "variant") for g in S.KEPT_Q for s in (1, 2, 3)]
        self.assertEqual(got, want)
        self.assertTrue(all(r.steps == axis.steps("d64L2")[0] > steps20 for r in todo))
        ten = S.Schedule(S.PLANS["q-len10"], 4, True).runs(rows, "d64L2")[0]
        self.assertEqual({r.stage for r in ten}, {"seed", "variant"})
        size = S.Schedule(S.PLANS["q-size"], 4, True)
        todo96, waiting = size.runs(rows, "d96L3")
        self.assertIn("powersgd@0.1: a scape-0.1 run to match its bytes", waiting)
        steps96 = size.steps("d96L3")[0]
        scape96 = [{"size": "d96L3", "group": "scape-0.1", "steps": steps96, "seed": 1,
                    "bytes_per_step_steady": 300000.0, "final_val_loss": 2.0}]
        todo96, waiting = size.runs(rows + scape96, "d96L3")
        psgd = [r for r in todo96 if r.group == "powersgd@0.1"]
        self.assertEqual([(r.seed, r.lr, r.stage) for r in psgd],
                         [(s, best["adamw"], "peer") for s in (1, 2, 3)])
        self.assertGreater(psgd[0].powersgd_rank, 0)
        self.assertEqual(waiting, ["powersgd@0.01: a scape-0.01 run to match its bytes"])
        # the re-check's table: AdamS at 40 tokens per parameter did better at twice its lr
        done = []
        for r in todo:
            if r.seed == 1 and r.group == "adams":
                done.append({"size": "d64L2", "size_label": "0.12M", "group": "adams",
                             "steps": r.steps, "seed": 1, "lr": r.lr, "stage": r.stage,
                             "tokens_per_param": 40.0,
                             "final_val_loss": {1e-3: 1.9, 5e-4: 2.0, 2e-3: 1.8}[r.lr]})
        _, table_best = qs.sweep_table(rows + done, {"unigram": 3.3, "bigram": 2.6})
        table = qs.lrcheck_table(rows + done, table_best)
        self.assertIn("| 0.12M | 40 | adams | 0.0005: 2.000, 0.001*: 1.900, 0.002: 1.800 | "
                      "no: 0.002 is 0.100 nats lower |", table)



if __name__ == "__main__":
    unittest.main()
