#!/usr/bin/env python3
"""Unit tests of perf/model.py: the step-time model reproduces hand-computed cases."""
import io
import os
import sys
import unittest
from contextlib import redirect_stdout

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "perf"))
import model  # noqa: E402


class RingCollectives(unittest.TestCase):
    def test_allreduce_two_ranks_no_latency(self):
        # 2(P-1)/P * S / B = 1 * 4e6 / 1e9 = 4 ms
        self.assertAlmostEqual(model.ring_allreduce_s(4e6, 2, 1e9, 0.0), 0.004, places=12)

    def test_allreduce_four_ranks_with_latency(self):
        # 2*3*10us + 2*3/4 * 8e6 / 2e9 = 60us + 6ms
        self.assertAlmostEqual(model.ring_allreduce_s(8e6, 4, 2e9, 1e-5), 0.00606, places=12)

    def test_single_rank_costs_nothing(self):
        self.assertEqual(model.ring_allreduce_s(1e9, 1, 1e9, 1e-5), 0.0)
        self.assertEqual(model.ring_allgather_s(1e9, 1, 1e9, 1e-5), 0.0)

    def test_allgather(self):
        # (P-1) a + (P-1)/P * S / B = 7*2us + 7/8 * 8e6 / 1e9 = 14us + 7ms
        self.assertAlmostEqual(model.ring_allgather_s(8e6, 8, 1e9, 2e-6), 0.007014, places=12)


class MaskBytes(unittest.TestCase):
    def test_k(self):
        self.assertEqual(model.mask_k(1000, 0.01), 10)
        self.assertEqual(model.mask_k(50, 0.01), 1)  # at least one
        self.assertEqual(model.mask_k(1000, 1.0), 1000)

    def test_elias_fano(self):
        # n/k = 100: L = floor(log2 100) = 6, so 8 bits per index: 1e4 indices -> 1e4 bytes
        self.assertEqual(model.elias_fano_bytes(10**6, 10**4), 10**4)
        # n/k = 10: L = 3, 5 bits: 1e5 indices -> 62500 bytes
        self.assertEqual(model.elias_fano_bytes(10**6, 10**5), 62500)

    def test_best_encoding(self):
        n, k = 10**6, 10**4
        self.assertEqual(model.mask_bytes(n, k, "bitmap"), n / 8)
        self.assertEqual(model.mask_bytes(n, k, "indices"), 4 * k)
        self.assertEqual(model.mask_bytes(n, k), 10**4)  # Elias-Fano is the smallest here
        self.assertEqual(model.mask_bytes(n, n), n / 8)  # density 1: the bitmap


class StepTimes(unittest.TestCase):
    def test_hand_computed_step(self):
        # n = 1e9, P = 32, B = 25e9 B/s, a = 5us, compute 0.25 s, density 0.01.
        # dense AR: 2*31*5e-6 + 2*31/32 * 4e9 / 25e9 = 3.1e-4 + 0.31
        # payload:  3.1e-4 + 2*31/32 * 4e7 / 25e9 = 3.1e-4 + 0.0031
        # mask: Elias-Fano, n/k = 100 -> 8 bits * 1e7 = 1e7 bytes;
        #       all-gather 31*5e-6 + 31/32 * 1e7 / 25e9 = 1.55e-4 + 3.875e-4 < compute: hidden
        s = model.step_times(1e9, 32, 25e9, 5e-6, 0.25, 0.01)
        self.assertEqual(s["k"], 10**7)
        self.assertAlmostEqual(s["dense_comm_s"], 0.31031, places=9)
        self.assertAlmostEqual(s["payload_s"], 0.00341, places=9)
        self.assertAlmostEqual(s["mask_bytes"], 1e7, places=3)
        self.assertAlmostEqual(s["mask_sync_s"], 5.425e-4, places=9)
        self.assertEqual(s["sync_excess_s"], 0.0)
        self.assertAlmostEqual(s["dense_step_s"], 0.56031, places=9)
        self.assertAlmostEqual(s["scape_step_s"], 0.25341, places=9)
        self.assertAlmostEqual(s["speedup"], 0.56031 / 0.25341, places=9)

    def test_sync_excess_counts_when_compute_is_short(self):
        s = model.step_times(1e9, 32, 25e9, 5e-6, 0.0, 0.01)
        self.assertAlmostEqual(s["sync_excess_s"], 5.425e-4, places=9)
        self.assertAlmostEqual(s["scape_step_s"], 0.00341 + 5.425e-4, places=9)

    def test_density_one_is_no_faster(self):
        s = model.step_times(1e8, 8, 10e9, 1e-6, 0.1, 1.0)
        # payload = the dense all-reduce; the bitmap sync (n/8 bytes) hides behind compute
        self.assertAlmostEqual(s["payload_s"], s["dense_comm_s"], places=12)
        self.assertLessEqual(s["speedup"], 1.0)

    def test_compute_for_speedup_inverts_the_model(self):
        c = model.compute_for_speedup(3.26, 1.8e9, 32, 25e9, 5e-6, 0.01)
        self.assertIsNotNone(c)
        self.assertAlmostEqual(model.step_times(1.8e9, 32, 25e9, 5e-6, c, 0.01)["speedup"], 3.26,
                               places=6)
        # Out of reach: the speedup with no compute at all is the ceiling.
        ceiling = model.step_times(1.8e9, 32, 25e9, 5e-6, 0.0, 0.01)["speedup"]
        self.assertIsNone(model.compute_for_speedup(ceiling * 2, 1.8e9, 32, 25e9, 5e-6, 0.01))


class CommandLine(unittest.TestCase):
    def run_main(self, argv):
        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = model.main(argv)
        return rc, buf.getvalue()

    def test_paper_setup_prints_the_comparison(self):
        rc, out = self.run_main([])
        self.assertEqual(rc, 0)
        self.assertIn("3.26x", out)
        self.assertIn("assumptions (not measured)", out)
        self.assertIn("200 Gb/s", out)

    def test_bad_density_is_an_error(self):
        with self.assertRaises(SystemExit) as cm:
            with redirect_stdout(io.StringIO()), \
                    open(os.devnull, "w") as devnull:
                sys.stderr, old = devnull, sys.stderr
                try:
                    model.parse(["--density", "0"])
                finally:
                    sys.stderr = old
        self.assertNotEqual(cm.exception.code, 0)


if __name__ == "__main__":
    unittest.main()
