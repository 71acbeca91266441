"""ScapeAdamS as a torch optimizer (issue 32): optimizer.state, parameters given twice, a dtype
changed after construction, zero_grad(set_to_none=True), and the consolidated state_dict that
one rank saves and every rank resumes from (what Hugging Face Trainer needs)."""
from __future__ import annotations

import unittest

from _harness import run_ranks


class TorchLike(unittest.TestCase):
    def test_state_is_a_read_only_per_parameter_view(self):
        res = run_ranks("optim_tl_state", 2, timeout=120)
        self.assertEqual(len({r["hash"] for r in res}), 1, "ranks differ")
        self.assertLess(res[0]["worst"], 1e-6)

    def test_parameter_given_twice_is_refused(self):
        res = run_ranks("optim_tl_duplicates", 1, timeout=60)
        e = res[0]["errors"]
        self.assertEqual(e["one_group"][0], "InvalidArgumentError")
        self.assertIn("appear more than once in a parameter group", e["one_group"][1])
        self.assertEqual(e["two_groups"][0], "ValueError")
        self.assertIn("some parameters appear in more than one parameter group",
                      e["two_groups"][1])

    def test_dtype_change_after_construction_is_an_error_naming_the_parameter(self):
        res = run_ranks("optim_tl_dtype_change", 2, timeout=120)
        for r in res:
            name, arg, msg = r["error"]
            self.assertEqual(arg, "params")
            self.assertIn("param group 0, parameter 0 (shape (12, 7))", msg)
            self.assertIn("torch.float64", msg)

    def test_zero_grad_set_to_none(self):
        res = run_ranks("optim_tl_set_to_none", 2, timeout=120)
        self.assertEqual(len({r["hash"] for r in res}), 1, "ranks differ")

    def test_consolidated_state_dict_resumes_every_rank(self):
        res = run_ranks("optim_tl_consolidated", 2, timeout=120)
        self.assertEqual(len({r["hash"] for r in res}), 1, "ranks differ")
        for r in res:
            self.assertIn("lacks the optimizer state of rank 1 (of 2; it holds the parts of "
                          "ranks [0])", r["error"][1])
            self.assertIn("lacks the optimizer state of rank 1 (of 2; it holds the own state "
                          "of rank 0 of 2)", r["own"][1])
        self.assertIn("stale", res[0]["stale"])


if __name__ == "__main__":
    unittest.main()
