"""ScapeAdamS as torch users expect of an optimizer (issue 22): every hyperparameter a scheduler
may change is read at each step (OneCycleLR cycles beta1), checked against the C API driven
directly; bad values raise naming the key; GradScaler skips a step on every rank together;
non-finite gradients skip the step on every rank (or raise, nonfinite="error")."""
from __future__ import annotations

import math
import unittest

from _harness import run_ranks


class HyperparametersTest(unittest.TestCase):
    def test_onecycle_with_cycle_momentum_matches_the_c_api(self):
        res = run_ranks("optim_onecycle", 2, 20, timeout=180)
        self.assertEqual(len({r["hash"] for r in res}), 1, "ranks differ")
        for r in res:
            self.assertEqual(r["hash"], r["raw"], "ScapeAdamS + OneCycleLR != the C API setters")
            self.assertNotEqual(r["hash"], r["nocycle"], "cycling beta1 had no effect")
        b1 = res[0]["beta1"]
        self.assertEqual(len(b1), 20)
        self.assertLess(min(b1), 0.86)  # base_momentum 0.85 at the peak of the lr
        self.assertGreater(max(b1), 0.94)  # max_momentum 0.95 at both ends

    def test_bad_values_raise_naming_the_key(self):
        res = run_ranks("optim_hyper_errors", 2, timeout=120)
        for r in res:
            e = r["errors"]
            for key in ("betas", "eps", "weight_decay", "lr"):
                for name, arg in e[key]:
                    self.assertEqual(name, "InvalidArgumentError", key)
                    self.assertEqual(arg, key)
            self.assertEqual(e["pair"][0], "InvalidArgumentError")
            self.assertIn("lr * weightDecay", e["pair"][1])


class GlobalClipTest(unittest.TestCase):
    def test_one_norm_over_every_group_as_clip_grad_norm(self):
        for n in (1, 2, 3):
            with self.subTest(nranks=n):
                res = run_ranks("optim_global_clip", n, 3, timeout=180)
                self.assertEqual(len({r["hash"] for r in res}), 1, "ranks differ")
                for r in res:
                    for row in r["rows"]:
                        self.assertAlmostEqual(row["norm"] / row["ref_norm"], 1.0, delta=1e-5,
                                               msg=row)
                        self.assertLess(row["scale"], 0.5, "the test does not clip")
                        self.assertAlmostEqual(row["scale"] / row["ref_scale"], 1.0, delta=1e-5,
                                               msg=row)
                        # one factor and one norm in every group
                        self.assertEqual(set(row["group_scales"]), {row["scale"]}, row)
                        self.assertEqual(set(row["group_norms"]), {row["norm"]}, row)
                    self.assertEqual(r["bad"][0], "max_grad_norm", r["bad"])
                    self.assertEqual(r["added"], ["max_grad_norm", 3, 3], r["added"])
                    self.assertIn("param group 1", r["bad"][1])


    def test_clip_norm_staying_and_local(self):
        res = run_ranks("optim_clip_norm", 2, 4, timeout=180)
        self.assertEqual(len({r["staying"]["hash"] for r in res}), 1, "ranks differ")
        for r in res:
            self.assertLess(r["recovered"]["scales"][0], 1.0, r)
            self.assertEqual(r["staying"]["scales"][0], 1.0, "no coordinate stays at step 0")
            self.assertLess(min(r["staying"]["scales"][1:]), 1.0, "staying never clipped")
            self.assertNotEqual(r["staying"]["hash"], r["recovered"]["hash"])
            self.assertEqual(r["staying"]["group"], "staying")
            self.assertEqual(r["bad"], "clip_norm")
        # local: this rank's own norm and factor, identical parameters on every rank
        self.assertEqual(len({r["local"]["hash"] for r in res}), 1, "ranks differ")
        self.assertNotEqual(res[0]["local"]["local"], res[1]["local"]["local"])
        for r in res:
            loc = r["local"]
            self.assertEqual(loc["group"], "local")
            self.assertNotEqual(loc["hash"], r["recovered"]["hash"])
            for norm, want, scale in zip(loc["norms"], loc["local"], loc["scales"]):
                self.assertAlmostEqual(norm / want, 1.0, delta=1e-6)
                self.assertAlmostEqual(scale / min(1.0, 1e-3 / (want + 1e-6)), 1.0, delta=1e-6)


class DensityWarmupTest(unittest.TestCase):
    def test_warmup_fraction_is_the_warmup_over_that_share_of_total_steps(self):
        res = run_ranks("optim_warmup_fraction", 2, 6, timeout=180)
        self.assertEqual(len({r["fraction"]["hash"] for r in res}), 1, "ranks differ")
        for r in res:
            self.assertEqual(r["fraction"]["warmup_steps"], 4)
            self.assertEqual(r["fraction"]["density"], r["steps"]["density"])
            self.assertEqual(r["fraction"]["hash"], r["steps"]["hash"])
            self.assertNotEqual(r["fraction"]["density"], r["none"]["density"],
                                "the warm-up changed nothing: the test cannot tell")
            self.assertEqual(r["bad"], ["total_steps", "warmup_fraction", "warmup_fraction",
                                        "total_steps", "warmup_steps"])


class GradScalerTest(unittest.TestCase):
    def test_one_rank_inf_skips_the_step_on_every_rank(self):
        for n in (1, 2, 3):
            with self.subTest(nranks=n):
                res = run_ranks("optim_gradscaler", n, 6, 3, timeout=180)
                self.assertEqual(len({r["hash"] for r in res}), 1, "ranks differ")
                self.assertEqual(len({tuple(r["scales"]) for r in res}), 1, "scales differ")
                for r in res:
                    self.assertEqual(r["hash"], r["plain"])
                    s = r["scales"]
                    # growth_interval 2: x2 after step 1, /2 after the bad step 3
                    self.assertEqual(s[3], s[2] / 2, s)
                    self.assertEqual(s[1], 2 * s[0], s)
                    # the disabled (CPU) GradScaler passes step() through (no bad step there)
                    self.assertEqual(r["disabled"], r["plain_all"])
                    self.assertNotEqual(r["plain_all"], r["plain"])


class NonFiniteTest(unittest.TestCase):
    def test_skip_by_default_error_on_request(self):
        for n in (1, 2, 3):
            with self.subTest(nranks=n):
                res = run_ranks("optim_nonfinite", n, 6, 3, timeout=180)
                self.assertEqual(len({r["hash"] for r in res}), 1, "ranks differ")
                for r in res:
                    self.assertEqual(r["hash"], r["plain"], "skip != a run without the step")
                    self.assertEqual(r["error_hash"], r["plain"], "error mode changed the run")
                    self.assertIsNone(r["skip_error"])
                    self.assertEqual(r["skipped"], 1)
                    self.assertEqual(r["error"][0], "InvalidArgumentError")
                    self.assertIn(f"rank {n - 1} are not finite", r["error"][1])
                    self.assertEqual(r["bad_kw"], "nonfinite")


if __name__ == "__main__":
    unittest.main()


class PayloadTypesTest(unittest.TestCase):
    def test_python_types_are_the_library_table(self):
        """DataType has one member per row of kernels/dtypes.h, with its size, names and
        payload flag (a type added to the table and not here fails)."""
        import os
        import re

        from scape import DataType
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
        src = open(os.path.join(root, "kernels", "dtypes.h")).read()
        body = src[src.index("constexpr TypeRow kTypes[] = {"):]
        body = body[:body.index("};")]
        rows = re.findall(r'\{(scape\w+),\s*"(\w+)",\s*"(\w+)",\s*"(\w+)",\s*(\d+),\s*(true|false),'
                          r'\s*(true|false)', body)
        self.assertEqual(len(rows), len(DataType), rows)
        for i, (cenum, cname, short, torch_name, size, _floating, payload) in enumerate(rows):
            t = DataType(i)
            self.assertEqual(cenum, cname)
            self.assertEqual(t.short, short, cname)
            self.assertEqual(t.label, torch_name, cname)
            self.assertEqual(t.size, int(size), cname)
            self.assertEqual(t.is_payload, payload == "true", cname)

    def test_every_payload_type_trains_and_fp8_sends_a_quarter(self):
        res = run_ranks("optim_payload_types", 2, 6, timeout=180)
        for name in ("fp32", "bf16", "e4m3", "e5m2"):
            self.assertEqual(len({r[name]["hash"] for r in res}), 1, f"ranks differ ({name})")
        r = res[0]
        for name in ("bf16", "e4m3", "e5m2"):
            self.assertNotEqual(r[name]["hash"], r["fp32"]["hash"], f"{name} changed nothing")
            self.assertTrue(all(math.isfinite(x) for x in r[name]["losses"]), r[name]["losses"])
        self.assertEqual(r["bf16"]["payload"] * 2, r["fp32"]["payload"])
        self.assertEqual(r["e4m3"]["payload"] * 4, r["fp32"]["payload"])
        self.assertEqual(r["e5m2"]["payload"] * 4, r["fp32"]["payload"])
        # the scale agreement: one float all-reduced (4 bytes per other rank)
        self.assertEqual(r["e4m3"]["control"] - r["fp32"]["control"], 4)
        self.assertEqual(r["e4m3"]["saved"], 5)
        self.assertEqual(r["e5m2"]["saved"], 6)
        self.assertEqual(r["bad"], "payload_dtype")
