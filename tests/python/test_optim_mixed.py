"""scape.optim.ScapeAdamS with bf16/fp16 parameters and fp32 master weights on real ranks:
the parameters are the rounded masters after every step, ranks agree bit for bit, resume at
step 17 reaches step 50 with the same bits, the masters are in state_dict, errors name the
argument."""
from __future__ import annotations

import unittest

from _harness import run_ranks


class ScapeAdamSMixedTest(unittest.TestCase):
    def test_bf16_masters_fifty_steps_resume_at_17(self):
        res = run_ranks("optim_mixed_bf16_masters", 2, timeout=240)
        self.assertEqual(len({r["hash"] for r in res}), 1, "ranks' parameters differ")
        self.assertEqual(len({r["master_hash"] for r in res}), 1, "ranks' masters differ")

    def test_fp16_sharded_equals_replicated(self):
        res = run_ranks("optim_mixed_fp16_sharded", 3, timeout=240)
        self.assertEqual(len({r["hash"] for r in res}), 1, "ranks differ")

    def test_fp32_grads_as_main_grad(self):
        res = run_ranks("optim_mixed_fp32_grads", 2, timeout=240)
        self.assertEqual(len({r["hash"] for r in res}), 1, "ranks differ")

    def test_errors_name_the_argument(self):
        res = run_ranks("optim_mixed_errors", 2, timeout=120)
        for r in res:
            e = r["errors"]
            self.assertEqual(e["mixed_dtypes"][1], "params")
            self.assertIn("mixes dtypes", e["mixed_dtypes"][2])
            self.assertEqual(e["float64"][1], "params")
            self.assertEqual(e["no_masters_16"][1], "master_weights")
            self.assertEqual(e["masters_fp32"][1], "master_weights")
            self.assertEqual(e["changed"][1], "master_weights")
            self.assertEqual(e["grad_dtype"][1], "grad_dtype")


if __name__ == "__main__":
    unittest.main()
