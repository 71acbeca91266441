"""Multi-rank tests of the binding: real processes launched with RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT on loopback, meeting over the library's bootstrap and UCX."""
from __future__ import annotations

import unittest

from _harness import run_ranks


def same(results, key="hash"):
    vals = {r[key] for r in results}
    return len(vals) == 1


class Collectives(unittest.TestCase):
    def test_collectives_against_float64_reference(self):
        for n in (1, 2, 3, 4):
            with self.subTest(nranks=n):
                res = run_ranks("collectives", n, 1, timeout=240)
                self.assertTrue(same(res), "ranks received different bits")

    def test_unique_id_path(self):
        res = run_ranks("unique_id", 3)
        self.assertEqual([r["sum"] for r in res], [6, 6, 6])

    def test_sparse_all_reduce(self):
        for n in (2, 3):
            with self.subTest(nranks=n):
                res = run_ranks("sparse", n, timeout=120)
                self.assertTrue(same(res))


class Masks(unittest.TestCase):
    def test_masks_shards_and_segments(self):
        for n, own, d in ((2, "shards", 0.01), (3, "shards", 0.1), (4, "segments", 0.1),
                          (3, "segments", 1.0)):
            with self.subTest(nranks=n, ownership=own, density=d):
                res = run_ranks("mask", n, own, d, timeout=120)
                self.assertTrue(same(res))
                self.assertEqual(len({str(r["bytes"]) for r in res}), 1)


class Errors(unittest.TestCase):
    def test_argument_and_mismatch_errors_are_exceptions(self):
        res = run_ranks("errors", 2)
        for r in res:
            c = r["caught"]
            self.assertEqual(c["noncontig"][1], "send")
            self.assertIn("contiguous", c["noncontig"][2])
            self.assertEqual(c["dtype"][0], "ArgumentTypeError")
            self.assertIn("float64", c["dtype"][2])
            self.assertEqual(c["size"][1], "recv")
            self.assertEqual(c["mixed"][1], "recv")
            self.assertEqual(c["rs_size"][1], "send")
            self.assertEqual(c["ag_size"][1], "recv")
            self.assertEqual(c["op"][1], "op")
            self.assertEqual(c["root"][1], "root")
            self.assertEqual(c["not_buffer"][1], "send")
            self.assertEqual(c["readonly"][1], "send")
            # the library's own message, with the function name
            self.assertIn("scapeAllReduce", r["mismatch"][2])
            self.assertIn(r["mismatch"][0], ("InvalidUsageError", "RemoteError"))

    def test_dead_peer_raises_on_survivors(self):
        res = run_ranks("peer_dies", 3, expect_fail=True, lib_timeout_ms=10000, timeout=60)
        self.assertEqual(res[2]["_exit"], 3)
        for r in res[:2]:
            self.assertEqual(r["_exit"], 0, r["_log"])
            self.assertIn(r["error"][0], ("RemoteError", "ScapeTimeoutError"))
            self.assertLess(r["seconds"], 30)

    def test_abort_from_watchdog_thread(self):
        res = run_ranks("abort_thread", 2, lib_timeout_ms=20000, timeout=60)
        self.assertEqual(res[0]["error"][0], "InvalidUsageError")
        self.assertLess(res[0]["seconds"], 10)
        self.assertIn(res[1]["error"][0], ("RemoteError", "ScapeTimeoutError"))

    def test_exception_in_with_block_aborts_and_peers_fail_fast(self):
        res = run_ranks("context_abort", 2, lib_timeout_ms=20000, timeout=60)
        self.assertTrue(res[0]["aborted"])
        self.assertEqual(res[1]["error"][0], "RemoteError")
        self.assertLess(res[1]["seconds"], 10, "the peer waited for the timeout")


if __name__ == "__main__":
    unittest.main()
