"""scape.optim.ScapeAdamS on real ranks: against a float64 AdamS reference at density 1,
sharded == replicated bit for bit, checkpoints through the library, errors."""
from __future__ import annotations

import unittest

from _harness import run_ranks


class ScapeAdamSTest(unittest.TestCase):
    def test_dense_matches_float64_adams_with_lr_schedule(self):
        for n in (1, 2, 3):
            with self.subTest(nranks=n):
                res = run_ranks("optim_dense_reference", n, timeout=120)
                self.assertEqual(len({r["hash"] for r in res}), 1, "ranks differ")
                self.assertLess(res[0]["worst"], 1e-5)

    def test_sharded_equals_replicated_and_dense_rule(self):
        for n in (2, 3):
            with self.subTest(nranks=n):
                res = run_ranks("optim_sharded_matches_replicated", n, timeout=120)
                self.assertEqual(len({r["hash"] for r in res}), 1, "ranks differ")

    def test_configuration_fields_reach_the_library(self):
        res = run_ranks("optim_config_fields", 2, timeout=120)
        self.assertEqual(len({r["hash"] for r in res}), 1)

    def test_checkpoint_resume_is_bit_identical_and_bad_checkpoint_refused(self):
        res = run_ranks("optim_checkpoint", 2, timeout=120)
        self.assertEqual(len({r["hash"] for r in res}), 1)
        self.assertEqual(res[1]["error"][0], "InvalidArgumentError")  # the corrupted rank
        self.assertEqual(res[0]["error"][0], "InvalidUsageError")     # told by the others
        self.assertIn("scapeOptimLoad", res[0]["error"][1])

    def test_entering_segment_rms(self):
        for n in (2, 3):
            with self.subTest(nranks=n):
                res = run_ranks("optim_entering", n, timeout=120)
                self.assertEqual(len({r["hash"] for r in res}), 1, "ranks differ")
                self.assertEqual(len({r["masked_hash"] for r in res}), 1,
                                 "ranks differ (segment_rms_masked)")
                self.assertEqual(res[0]["error"], ["InvalidArgumentError", "entering"])

    def test_errors_are_exceptions(self):
        res = run_ranks("optim_errors", 2, timeout=120)
        for r in res:
            e = r["errors"]
            self.assertEqual(e["dtype"][1], "params")
            self.assertEqual(e["density"][1], "density")
            self.assertEqual(e["betas"][1], "betas")
            self.assertEqual(e["payload"][1], "payload_dtype")
            self.assertEqual(e["comm"][1], "comm")
            self.assertEqual(e["changed"][1], "density")
            self.assertIn("scapeOptimCreate", e["layout"][2])


if __name__ == "__main__":
    unittest.main()
