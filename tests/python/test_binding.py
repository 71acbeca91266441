"""Single-process tests of the binding: loading, argument checks, errors, one-rank
collectives and masks, lifetimes."""
from __future__ import annotations

import os
import subprocess
import sys
import unittest

import numpy as np

import scape
from _harness import PYTHON

try:
    import torch
except ImportError:  # pragma: no cover - Debian's python3-torch is installed by the set-up
    torch = None


def run_py(code: str, env=None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    if env is not None:
        e.update(env)
    return subprocess.run([PYTHON, "-c", code], env=e, capture_output=True, text=True,
                          timeout=60)


class Loading(unittest.TestCase):
    def test_import_pulls_in_neither_torch_nor_numpy(self):
        p = run_py("import sys, scape; c = scape.version(); "
                   "print(c, 'torch' in sys.modules, 'numpy' in sys.modules)")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.split(), ["100", "False", "False"])

    def test_scape_library_env_is_honoured_and_checked(self):
        p = run_py("import scape; scape.version()", env={"SCAPE_LIBRARY": "/nonexistent/x.so"})
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("SCAPE_LIBRARY='/nonexistent/x.so'", p.stderr)

    def test_library_path_and_version(self):
        self.assertIn("libnccl-net-scape.so", scape.library_path())
        self.assertEqual(scape.version(), scape.BINDING_VERSION_CODE)

    def test_from_env_without_launcher_names_the_variables(self):
        env = {k: "" for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                               "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID",
                               "SLURM_NTASKS")}
        code = ("import os, scape\n"
                "for k in %r: os.environ.pop(k, None)\n"
                "try:\n    scape.Communicator.from_env()\n"
                "except scape.InvalidUsageError as e:\n    print('OK', e)\n" % list(env))
        p = run_py(code)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertTrue(p.stdout.startswith("OK scapeCommInitFromEnv"), p.stdout)
        self.assertIn("RANK", p.stdout)


class StructLayouts(unittest.TestCase):
    """The ctypes mirrors of the C structs have the header's sizes and field offsets (compiled
    against include/scape/scape.h with the system C compiler)."""

    def test_ctypes_structs_match_the_header(self):
        import ctypes
        import shutil
        import tempfile

        from scape import _lib
        from scape import optim as so  # needs torch

        cc = shutil.which("cc") or shutil.which("gcc")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        lib_dir = os.path.dirname(os.path.realpath(scape.library_path()))
        gen = os.path.join(os.path.dirname(lib_dir), "include")  # <build>/include
        if cc is None:
            self.skipTest("no C compiler")
        structs = {"scapeConfig_t": _lib.ConfigStruct, "scapeMaskSyncInfo_t":
                   _lib.MaskSyncInfoStruct, "scapeOptimConfig_t": so._OptimConfig,
                   "scapeOptimInfo_t": so._OptimInfo, "scapeUniqueId": _lib.UniqueIdStruct}
        lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <scape/scape.h>",
                 "int main(void) {"]
        for cname, py in structs.items():
            lines.append(f'printf("{cname} sizeof() %zu\\n", sizeof({cname}));')
            for fname, _ in py._fields_:
                lines.append(f'printf("{cname} {fname} %zu\\n", offsetof({cname}, {fname}));')
        lines.append("return 0; }")
        with tempfile.TemporaryDirectory() as d:
            src, exe = os.path.join(d, "layout.c"), os.path.join(d, "layout")
            with open(src, "w") as f:
                f.write("\n".join(lines))
            p = subprocess.run([cc, "-I", os.path.join(root, "include"), "-I", gen, src, "-o",
                                exe], capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, 0, p.stderr)
            out = subprocess.run([exe], capture_output=True, text=True, timeout=10).stdout
        got = {}
        for line in out.splitlines():
            cname, what, val = line.split()
            got[(cname, what)] = int(val)
        for cname, py in structs.items():
            self.assertEqual(got[(cname, "sizeof()")], ctypes.sizeof(py), cname)
            for fname, _ in py._fields_:
                self.assertEqual(got[(cname, fname)], getattr(py, fname).offset,
                                 f"{cname}.{fname}")


class Launcher(unittest.TestCase):
    """python3 -m scape.launch: torchrun's variables, failure and timeout handling."""

    def launch(self, body: str, *opts: str):
        import tempfile
        import time

        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write("import os, sys, time\n" + body)
        try:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
            t0 = time.monotonic()
            p = subprocess.run([PYTHON, "-m", "scape.launch", "-n", "3", *opts, f.name],
                               env=env, capture_output=True, text=True, timeout=60)
            return p, time.monotonic() - t0
        finally:
            os.unlink(f.name)

    def test_sets_torchrun_variables(self):
        # one write per rank: the ranks share the pipe
        p, _ = self.launch("e = os.environ\nos.write(1, ('%s %s %s %s %s\\n' % (e['RANK'], "
                           "e['WORLD_SIZE'], e['LOCAL_RANK'], e['MASTER_ADDR'], "
                           "int(e['MASTER_PORT']) > 0)).encode())")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(sorted(p.stdout.splitlines()),
                         [f"{r} 3 {r} 127.0.0.1 True" for r in range(3)])

    def test_a_failing_rank_ends_the_job_with_its_status(self):
        p, dt = self.launch("if os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(50)",
                            "--grace", "1")
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertIn("rank 1 exited 3", p.stderr)
        self.assertLess(dt, 30)

    def test_timeout_kills_every_rank(self):
        p, dt = self.launch("time.sleep(50)", "--timeout", "2")
        self.assertEqual(p.returncode, 124, p.stderr)
        self.assertLess(dt, 30)


class Errors(unittest.TestCase):
    def test_hierarchy(self):
        self.assertTrue(issubclass(scape.InvalidArgumentError, ValueError))
        self.assertTrue(issubclass(scape.ArgumentTypeError, TypeError))
        self.assertTrue(issubclass(scape.ScapeTimeoutError, TimeoutError))
        self.assertTrue(issubclass(scape.ScapeSystemError, OSError))
        for cls in (scape.InvalidArgumentError, scape.InvalidUsageError, scape.RemoteError,
                    scape.ScapeTimeoutError, scape.UnsupportedError, scape.InternalError,
                    scape.ScapeSystemError):
            self.assertTrue(issubclass(cls, scape.ScapeError))
        e = scape.ScapeTimeoutError("x", function="scapeWait")
        self.assertEqual((e.code, str(e)), (5, "scapeWait: x"))

    def test_unique_id_checks(self):
        uid = scape.get_unique_id()
        self.assertEqual(len(bytes(uid)), 128)
        self.assertEqual(scape.UniqueId(bytes(uid)), uid)
        with self.assertRaises(scape.InvalidArgumentError) as cm:
            scape.UniqueId(b"short")
        self.assertEqual(cm.exception.argument, "data")

    def test_init_errors_carry_the_library_message(self):
        uid = scape.get_unique_id()
        with self.assertRaises(scape.InvalidArgumentError) as cm:
            scape.Communicator(2, uid, 5)
        self.assertIn("rank", str(cm.exception))
        self.assertTrue(str(cm.exception).startswith("scapeCommInitRank"))
        with self.assertRaises(scape.InvalidArgumentError) as cm:
            scape.Communicator(1, uid, 0, timeout_ms=0)
        self.assertEqual(cm.exception.argument, "timeout_ms")
        with self.assertRaises(scape.InvalidArgumentError) as cm:
            scape.Communicator(1, uid, 0, progress="fast")
        self.assertEqual(cm.exception.argument, "progress")
        with self.assertRaises(scape.ArgumentTypeError):
            scape.Communicator(1, b"x" * 128, 0)


class OneRank(unittest.TestCase):
    def setUp(self):
        self.comm = scape.Communicator(1, scape.get_unique_id(), 0, timeout_ms=10000,
                                       net_if="lo")

    def tearDown(self):
        self.comm.abort()

    def test_collectives_are_zero_copy_and_correct(self):
        c = self.comm
        self.assertEqual((c.rank, c.size), (0, 1))
        x = np.arange(11, dtype=np.float32)
        out = np.zeros_like(x)
        self.assertIs(c.all_reduce(x, out, op=scape.ReduceOp.AVG), out)
        np.testing.assert_array_equal(out, x)
        self.assertIs(c.all_reduce(x), x)
        g = c.all_gather(np.arange(5, dtype=np.int64))
        np.testing.assert_array_equal(g, np.arange(5))
        r = c.reduce_scatter(np.arange(6, dtype=np.int32), op="max")
        np.testing.assert_array_equal(r, np.arange(6))
        b = np.arange(4, dtype=np.float16)
        self.assertIs(c.broadcast(b, root=0), b)
        c.barrier()
        # empty buffers are fine
        c.all_reduce(np.zeros(0, np.float32))

    @unittest.skipIf(torch is None, "torch not installed")
    def test_torch_views_are_written_in_place(self):
        flat = torch.arange(12, dtype=torch.float32)
        view = flat[4:8]  # contiguous view with a storage offset
        self.comm.all_reduce(view, torch.full((4,), -1.0))
        self.comm.all_reduce(torch.full((4,), 9.0), view)
        self.assertEqual(flat[4:8].tolist(), [9.0] * 4)
        self.assertEqual(flat[3].item(), 3.0)
        self.assertEqual(flat[8].item(), 8.0)

    @unittest.skipIf(torch is None, "torch not installed")
    def test_bad_tensors_name_the_argument(self):
        c = self.comm
        cases = [
            (lambda: c.all_reduce(torch.zeros(3, 3).t()), "send", "contiguous"),
            (lambda: c.all_reduce(torch.zeros(3, dtype=torch.complex64)), "send", "complex64"),
            (lambda: c.all_reduce(torch.zeros(3, device="meta")), "send", "device"),
            (lambda: c.all_reduce(torch.zeros(3), torch.zeros(4)), "recv", "3"),
            (lambda: c.all_reduce(torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16)), "recv",
             "bfloat16"),
            (lambda: c.all_reduce(torch.zeros(3).to_sparse()), "send", "layout"),
            (lambda: c.broadcast(torch.zeros(3), root=-1), "root", "rank"),
            (lambda: c.all_gather(torch.zeros(2), torch.zeros(3)), "recv", "2"),
            (lambda: c.all_reduce(np.zeros(4, np.float32)[::2]), "send", "contiguous"),
            (lambda: c.sparse_all_reduce(np.array([1], np.uint64), np.ones(2, np.float32), 4),
             "values", "indices"),
            (lambda: c.sparse_all_reduce(np.array([1], np.int32), np.ones(1, np.float32), 4),
             "indices", "int32"),
        ]
        for fn, arg, text in cases:
            with self.subTest(arg=arg, text=text):
                with self.assertRaises(scape.InvalidArgumentError) as cm:
                    fn()
                self.assertEqual(cm.exception.argument, arg)
                self.assertIn(text, str(cm.exception))
        # still usable
        x = torch.ones(3)
        c.all_reduce(x)
        self.assertEqual(x.tolist(), [1.0] * 3)

    def test_library_errors_surface_with_the_library_message(self):
        c = self.comm
        # out-of-range index: checked by the library, raised with its message
        with scape.Mask(c, [10]) as m:
            with self.assertRaises(scape.InvalidArgumentError) as cm:
                m.set_next_indices([3, 11])
            self.assertIn("scapeMaskSetNextIndices", str(cm.exception))
            with self.assertRaises(scape.InvalidArgumentError) as cm:
                m.set_next_indices([5, 2])
            # advance without a sync: usage error from the library
            with self.assertRaises(scape.InvalidUsageError) as cm:
                m.advance()
            self.assertIn("scapeMaskAdvance", str(cm.exception))

    def test_mask_lifecycle_and_checks(self):
        c = self.comm
        m = c.create_mask([4, 0, 6], dense=[True, False, False], ownership="segments",
                          encoding="elias_fano")
        self.assertEqual((m.n, m.offsets, m.count), (10, [0, 4, 4, 10], 0))
        self.assertEqual(m.owned_ranges(), [(0, 10)])
        stat = np.array([0, 0, 0, 0, 1, -9, 3, 2, 0, 8], np.float32)
        m.select_next_topk(stat, 0.34)
        m.sync_start()
        with self.assertRaises(scape.InvalidUsageError):
            m.select_next_topk(stat, 0.5)  # the next mask is frozen while a sync is in flight
        m.sync_wait()
        self.assertTrue(m.sync_test())
        m.advance()
        np.testing.assert_array_equal(m.indices(), [0, 1, 2, 3, 5, 9])
        self.assertEqual(m.rank_count(), (6, 0))
        info = m.sync_info()
        self.assertEqual(info.encoding, scape.MaskEncoding.ELIAS_FANO)
        self.assertGreater(info.sent_bytes, 0)
        d = np.arange(10, dtype=np.float32)
        p = m.pack(d)
        np.testing.assert_array_equal(p, [0, 1, 2, 3, 5, 9])
        out = np.full(10, -1, np.float32)
        m.unpack(p * 2, out)
        np.testing.assert_array_equal(out, [0, 2, 4, 6, -1, 10, -1, -1, -1, 18])
        out2 = np.full(10, -1, np.float32)
        c.all_reduce(d, out2, mask=m)
        np.testing.assert_array_equal(out2, [0, 1, 2, 3, -1, 5, -1, -1, -1, 9])
        for fn, arg in [(lambda: m.select_next_topk(stat[:9], 0.1), "statistic"),
                        (lambda: m.select_next_topk(stat, 0.0), "density"),
                        (lambda: m.select_next_topk(stat.astype(np.float16), 0.1), "statistic"),
                        (lambda: m.pack(d, np.zeros(5, np.float32)), "packed"),
                        (lambda: m.owned_ranges(1), "rank"),
                        (lambda: c.all_reduce(d[:9], mask=m), "send"),
                        (lambda: c.all_reduce(d, mask="m"), "mask"),
                        (lambda: scape.Mask(c, []), "segments"),
                        (lambda: scape.Mask(c, [3], dense=[1, 0]), "dense"),
                        (lambda: scape.Mask(c, [3], ownership="ring"), "ownership")]:
            with self.subTest(arg=arg):
                with self.assertRaises(scape.InvalidArgumentError) as cm:
                    fn()
                self.assertEqual(cm.exception.argument, arg)
        m.destroy()
        self.assertFalse(m.alive)
        with self.assertRaises(scape.InvalidUsageError):
            m.count
        m.destroy()  # second destroy is a no-op

    def test_mask_of_another_communicator_is_rejected(self):
        other = scape.Communicator(1, scape.get_unique_id(), 0, timeout_ms=10000)
        with other, scape.Mask(other, [5]) as m:
            with self.assertRaises(scape.InvalidArgumentError) as cm:
                self.comm.all_reduce(np.zeros(5, np.float32), mask=m)
            self.assertEqual(cm.exception.argument, "mask")

    def test_requests_and_destroy_order(self):
        c = scape.Communicator(1, scape.get_unique_id(), 0, timeout_ms=10000)
        x = np.ones(100, np.float32)
        req = c.all_reduce(x, op="sum", async_op=True)
        self.assertIsInstance(req, scape.Request)
        self.assertIs(req.wait(), x)
        self.assertTrue(req.completed)
        m = scape.Mask(c, [100])
        c.destroy()  # destroys the mask first
        self.assertFalse(m.alive)
        self.assertFalse(c.alive)
        with self.assertRaises(scape.InvalidUsageError):
            c.barrier()
        c.destroy()
        c.abort()

    def test_context_manager_destroys_and_abort_frees_masks(self):
        with scape.Communicator(1, scape.get_unique_id(), 0) as c:
            self.assertTrue(c.alive)
        self.assertFalse(c.alive)
        c = scape.Communicator(1, scape.get_unique_id(), 0)
        m = scape.Mask(c, [8])
        c.abort()
        self.assertFalse(m.alive)
        m.destroy()


if __name__ == "__main__":
    unittest.main()
