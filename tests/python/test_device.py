"""The binding's device path without a GPU (issue 22): the C tests' CPU fake device runtime
installed into the library (tests/python/fakedev_shim.cc, SCAPE_TEST_FAKEDEV), stand-in CUDA
arrays over its memory (``__cuda_array_interface__`` and DLPack, tests/python/_fakedev.py),
and the fake libnccl (SCAPE_TEST_FAKE_NCCL) for the NCCL backend made from Python.

- On 1-3 real ranks (device_worker.py): every collective and mask call on device stand-ins
  gives the host path's bits; the stream of the interface is the one the work goes on, and
  the call returns without waiting for it; UCX and NCCL backends, from_env and
  from_process_group.
- In this process: every refusal raises naming the argument.
"""
from __future__ import annotations

import os
import unittest

import numpy as np

import _fakedev as fd
import scape
from _harness import run_ranks

HAVE = fd.available() and os.path.exists(os.environ.get("SCAPE_TEST_FAKE_NCCL", ""))


@unittest.skipUnless(HAVE, "SCAPE_TEST_FAKEDEV / SCAPE_TEST_FAKE_NCCL not set (run by ctest)")
class DeviceRanks(unittest.TestCase):
    def _run(self, backend, how, sizes):
        for n in sizes:
            with self.subTest(backend=backend, how=how, nranks=n):
                seed = int.from_bytes(os.urandom(2), "little")
                res = run_ranks("device_coll", n, backend, how, seed, timeout=180)
                self.assertEqual(len({r["hash"] for r in res}), 1,
                                 "ranks received different bits")
                self.assertIn("stream hand-off", res[0]["checked"])
                self.assertIn("masked all_reduce", res[0]["checked"])
                # The call returned while its stream was held (it did not wait for it).
                for r in res:
                    self.assertLess(r["returned_s"], 5.0)

    def test_ucx_backend_from_env(self):
        self._run("ucx", "env", (1, 2, 3))

    def test_nccl_backend_from_env(self):
        self._run("nccl", "env", (1, 2, 3))

    def test_from_process_group(self):
        self._run("nccl", "pg", (2,))
        self._run("ucx", "pg", (3,))


@unittest.skipUnless(HAVE, "SCAPE_TEST_FAKEDEV / SCAPE_TEST_FAKE_NCCL not set (run by ctest)")
class Refusals(unittest.TestCase):
    """Every refusal raises before the library is called, naming the argument."""

    @classmethod
    def setUpClass(cls):
        fd.install()
        cls.comm = scape.Communicator(1, scape.get_unique_id(), 0, device=0)

    @classmethod
    def tearDownClass(cls):
        cls.comm.destroy()

    def refuse(self, arg, fn, *, type_error=False, contains=""):
        exc = scape.ArgumentTypeError if type_error else scape.InvalidArgumentError
        with self.assertRaises(exc) as cm:
            fn()
        self.assertEqual(cm.exception.argument, arg, str(cm.exception))
        self.assertIn(contains, str(cm.exception))
        return cm.exception

    def test_host_device_mixes(self):
        c = self.comm
        h = np.zeros(8, np.float32)
        d = fd.FakeCudaArray(np.zeros(8, np.float32))
        self.refuse("recv", lambda: c.all_reduce(h, d), contains="device memory but send")
        self.refuse("recv", lambda: c.all_reduce(d, h), contains="host memory but send")
        self.refuse("recv", lambda: c.all_gather(d, h))
        m = c.create_mask([8])
        m.set_next_indices(np.array([1, 5], np.uint64))
        m.sync_start(), m.sync_wait(), m.advance()
        self.refuse("packed", lambda: m.pack(d, np.zeros(2, np.float32)))
        self.refuse("dense", lambda: m.unpack(np.zeros(2, np.float32), d))
        self.refuse("recv", lambda: m.all_reduce_packed(fd.FakeCudaArray(np.zeros(2, np.float32)),
                                                        np.zeros(2, np.float32)))
        m.destroy()

    def test_wrong_device(self):
        c = self.comm
        self.assertEqual(c.device, 0)
        d0 = fd.FakeCudaArray(np.zeros(8, np.float32), device=0)
        d1 = fd.FakeCudaArray(np.zeros(8, np.float32), device=1)
        self.refuse("send", lambda: c.all_reduce(d1), contains="cuda:1")
        self.refuse("recv", lambda: c.all_reduce(d0, d1), contains="cuda:1")
        self.refuse("buf", lambda: c.broadcast(d1), contains="communicator works on cuda:0")

    def test_non_contiguous(self):
        c = self.comm
        a = fd.FakeCudaArray(np.zeros(16, np.float32), shape=(4, 2), strides=(16, 4))
        self.refuse("send", lambda: c.all_reduce(a), contains="contiguous")
        ok = fd.FakeCudaArray(np.zeros(8, np.float32), shape=(4, 2), strides=(8, 4))
        c.all_reduce(ok)  # explicit C-contiguous strides are accepted
        fd.sync(None)
        dl = fd.FakeDLPack(bytes(64), 8, code=2, bits=32, shape=[4, 2], strides=[4, 1])
        self.refuse("send", lambda: c.all_reduce(dl), contains="contiguous")

    def test_wrong_dtype(self):
        c = self.comm
        f64 = fd.FakeCudaArray(np.zeros(8, np.float64))
        self.refuse("send", lambda: c.all_reduce(f64), type_error=True, contains="'<f8'")
        i32 = fd.FakeCudaArray(np.zeros(8, np.int32))
        f32 = fd.FakeCudaArray(np.zeros(8, np.float32))
        self.refuse("recv", lambda: c.all_reduce(f32, i32), type_error=True)
        dl = fd.FakeDLPack(bytes(64), 8, code=2, bits=64)
        self.refuse("send", lambda: c.all_reduce(dl), type_error=True, contains="64 bits")
        m = c.create_mask([8])
        self.refuse("statistic", lambda: m.select_next_topk(i32, 0.5), type_error=True)
        m.destroy()

    def test_other_refusals(self):
        c = self.comm
        ro = fd.FakeCudaArray(np.zeros(8, np.float32), readonly=True)
        self.refuse("send", lambda: c.all_reduce(ro), contains="read-only")
        s1, s2 = fd.new_stream(), fd.new_stream()
        a = fd.FakeCudaArray(np.zeros(8, np.float32), stream=s1)
        b = fd.FakeCudaArray(np.zeros(8, np.float32), stream=s2)
        self.refuse("recv", lambda: c.all_reduce(a, b), contains="one stream")
        z = fd.FakeCudaArray(np.zeros(8, np.float32), stream=0)
        self.refuse("send", lambda: c.all_reduce(z), contains="0 is not allowed")
        d = fd.FakeCudaArray(np.zeros(8, np.float32))
        self.refuse("recv", lambda: c.all_gather(d), contains="pass it")
        self.refuse("values", lambda: c.sparse_all_reduce(np.zeros(8, np.uint64), d, 100),
                    contains="host memory only")
        self.refuse("send", lambda: c.all_reduce(object()), type_error=True,
                    contains="__cuda_array_interface__")

    def test_host_path_unchanged(self):
        x = np.arange(5, dtype=np.float32)
        self.assertIs(self.comm.all_reduce(x), x)
        np.testing.assert_array_equal(x, np.arange(5, dtype=np.float32))


@unittest.skipUnless(HAVE, "SCAPE_TEST_FAKEDEV / SCAPE_TEST_FAKE_NCCL not set (run by ctest)")
class NcclFromPython(unittest.TestCase):
    def setUp(self):
        self._saved = os.environ.get("SCAPE_NCCL_LIBRARY")

    def tearDown(self):
        if self._saved is None:
            os.environ.pop("SCAPE_NCCL_LIBRARY", None)
        else:
            os.environ["SCAPE_NCCL_LIBRARY"] = self._saved

    def test_one_rank_init_collective_destroy(self):
        fd.install()
        os.environ["SCAPE_NCCL_LIBRARY"] = os.environ["SCAPE_TEST_FAKE_NCCL"]
        c = scape.Communicator(1, scape.get_unique_id(), 0, backend="nccl")
        self.assertEqual(c.backend, "nccl")
        self.assertEqual((c.rank, c.size), (0, 1))
        x = fd.FakeCudaArray(np.arange(9, dtype=np.float32))
        c.all_reduce(x)
        np.testing.assert_array_equal(x.numpy(None), np.arange(9, dtype=np.float32))
        c.destroy()

    def test_nccl_missing_names_the_library(self):
        os.environ["SCAPE_NCCL_LIBRARY"] = "/nonexistent/nvidia/nccl/lib/libnccl.so.2"
        with self.assertRaises(scape.UnsupportedError) as cm:
            scape.Communicator(1, scape.get_unique_id(), 0, backend="nccl")
        self.assertIn("/nonexistent/nvidia/nccl/lib/libnccl.so.2", str(cm.exception))
        self.assertIn("scapeCommInitNcclRank", str(cm.exception))

    def test_bad_backend_and_device(self):
        with self.assertRaises(scape.InvalidArgumentError) as cm:
            scape.Communicator(1, scape.get_unique_id(), 0, backend="mpi")
        self.assertEqual(cm.exception.argument, "backend")
        with self.assertRaises(scape.InvalidArgumentError) as cm:
            scape.Communicator.from_env(backend="gloo")
        self.assertEqual(cm.exception.argument, "backend")
        os.environ["SCAPE_NCCL_LIBRARY"] = os.environ["SCAPE_TEST_FAKE_NCCL"]
        with self.assertRaises(scape.InvalidArgumentError) as cm:
            scape.Communicator(1, scape.get_unique_id(), 0, backend="nccl", device=-1)
        self.assertEqual(cm.exception.argument, "device")

    def test_from_process_group_needs_torch_distributed(self):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.skipTest("a process group exists")
        with self.assertRaises(scape.InvalidArgumentError) as cm:
            scape.Communicator.from_process_group()
        self.assertEqual(cm.exception.argument, "pg")

    def test_find_nccl_library_without_torch_cuda(self):
        # No libnccl is loaded here and Debian's CPU torch has no nvidia wheel: None, or a
        # path that exists.
        p = scape.find_nccl_library()
        self.assertTrue(p is None or os.path.exists(p), p)


@unittest.skipUnless(HAVE, "SCAPE_TEST_FAKEDEV / SCAPE_TEST_FAKE_NCCL not set (run by ctest)")
class MaskStreams(unittest.TestCase):
    """The mask calls without a stream argument in C run on their buffers' stream."""

    @classmethod
    def setUpClass(cls):
        fd.install()
        cls.comm = scape.Communicator(1, scape.get_unique_id(), 0, device=0)

    @classmethod
    def tearDownClass(cls):
        cls.comm.destroy()

    def test_mask_calls_run_on_the_buffers_stream(self):
        # Issue 31: pack, unpack and the device top-k run on the stream of their buffers (for
        # torch tensors torch's current stream), not on the default stream, which a
        # non-blocking stream does not order with: held behind a gate on that stream, the
        # work is not done until the gate opens.
        import threading
        import time

        c = self.comm
        m = c.create_mask([8])
        m.set_next_indices(np.array([1, 5], np.uint64))
        m.sync_start(), m.sync_wait(), m.advance()
        s = fd.new_stream()
        dense = fd.FakeCudaArray(np.arange(8, dtype=np.float32), stream=s)
        packed = fd.FakeCudaArray(np.zeros(2, np.float32), stream=s)
        gate = fd.Gate(s)
        m.pack(dense, packed)
        fd.sync(None)  # the default stream has nothing of it
        self.assertEqual(packed.numpy(stream=0).tolist(), [0.0, 0.0],
                         "pack ran before the work queued ahead of it on its stream")
        gate.open()
        self.assertEqual(packed.numpy().tolist(), [1.0, 5.0])
        out = fd.FakeCudaArray(np.zeros(8, np.float32), stream=s)
        gate = fd.Gate(s)
        m.unpack(packed, out)
        fd.sync(None)
        self.assertEqual(out.numpy(stream=0).tolist(), [0.0] * 8,
                         "unpack ran before the work queued ahead of it on its stream")
        gate.open()
        self.assertEqual(out.numpy().tolist(), [0, 1, 0, 0, 0, 5, 0, 0])
        # The top-k waits (on the host) for its stream: it returns only once the gate opens.
        stat = fd.FakeCudaArray(np.array([0, 9, 0, 0, 7, 0, 0, 1], np.float32), stream=s)
        gate = fd.Gate(s)
        done = threading.Event()
        errors = []

        def select():
            try:
                m.select_next_topk(stat, 0.25)
            except Exception as e:  # reported below
                errors.append(e)
            done.set()

        t = threading.Thread(target=select)
        t.start()
        time.sleep(0.3)
        returned_early = done.is_set()
        gate.open()
        t.join(30)
        self.assertFalse(returned_early, "the top-k did not wait for the statistic's stream")
        self.assertEqual(errors, [])
        m.sync_start(), m.sync_wait(), m.advance()
        self.assertEqual(sorted(m.indices().tolist()), [1, 4])
        m.destroy()

    def test_torch_current_stream_on_a_side_stream(self):
        # Issue 31, "What to build" 3: with torch's current stream set to a side stream (a
        # non-blocking one, as torch's are), DLPack buffers are handed that stream and the
        # mask calls and a staged collective go on it: held behind a gate there, nothing is
        # done (the legacy default stream, which the strict fake does not order with
        # non-blocking streams, has none of it) until the gate opens. torch here is a CPU
        # build: its CUDA stream API is stood in for by the fake's side stream.
        from unittest import mock

        import torch

        s = fd.new_stream()
        side = type("Stream", (), {"cuda_stream": s})()

        def read(buf, n):
            out = np.empty(n, np.float32)
            assert fd._shim.fakedev_copy(out.ctypes.data, buf.ptr, out.nbytes) == 0
            return out.tolist()

        c = self.comm
        m = c.create_mask([8])
        m.set_next_indices(np.array([2, 6], np.uint64))
        m.sync_start(), m.sync_wait(), m.advance()
        with mock.patch.object(torch.cuda, "is_initialized", lambda: True), \
                mock.patch.object(torch.cuda, "current_stream", lambda *a, **k: side):
            x = fd.FakeDLPack(np.arange(8, dtype=np.float32).tobytes(), 8, code=2, bits=32)
            packed = fd.FakeDLPack(np.zeros(2, np.float32).tobytes(), 2, code=2, bits=32)
            gate = fd.Gate(s)
            c.all_reduce(x, x)
            m.pack(x, packed)
            fd.sync(None)
            self.assertEqual(read(packed, 2), [0.0, 0.0],
                             "pack ran before the work queued ahead of it on the side stream")
            gate.open()
            fd.sync(s)
            self.assertEqual(read(x, 8), [float(i) for i in range(8)])
            self.assertEqual(read(packed, 2), [2.0, 6.0])
            self.assertTrue(x.streams_seen and all(v == s for v in x.streams_seen),
                            x.streams_seen)
        m.destroy()


if __name__ == "__main__":
    unittest.main()


class _CachingAllocator:
    """A Python device allocator over the fake device's memory, caching per (stream, size) as
    torch's caching allocator does; checks that every free matches its alloc."""

    def __init__(self) -> None:
        self.live = {}
        self.cache = {}
        self.allocs = self.frees = self.mismatches = 0
        self.streams = set()

    def alloc(self, nbytes, device, stream):
        self.allocs += 1
        self.streams.add(stream)
        free = self.cache.get((stream, nbytes))
        ptr = free.pop() if free else fd._shim.fakedev_alloc(nbytes)
        self.live[ptr] = (nbytes, device, stream)
        return ptr

    def free(self, ptr, nbytes, device, stream):
        self.frees += 1
        if self.live.pop(ptr, None) != (nbytes, device, stream):
            self.mismatches += 1
        self.cache.setdefault((stream, nbytes), []).append(ptr)

    def drain(self):
        for ptrs in self.cache.values():
            for p in ptrs:
                fd._shim.fakedev_free(p)
        self.cache.clear()


@unittest.skipUnless(HAVE, "SCAPE_TEST_FAKEDEV / SCAPE_TEST_FAKE_NCCL not set (run by ctest)")
class DeviceAllocator(unittest.TestCase):
    """Issue 31 finding 5: the library's device memory from the caller's allocator
    (Communicator(device_allocator=...), scapeConfig_t.deviceAllocator)."""

    def _rounds(self, comm, stream, rounds=5):
        m = comm.create_mask([1000, 2000])
        stat = fd.FakeCudaArray(np.random.default_rng(1).standard_normal(3000).astype(np.float32),
                                stream=stream)
        driver = []
        for _ in range(rounds):
            before = fd.counter("deviceAllocs")
            m.select_next_topk(stat, 0.05)  # the device top-k: pool blocks and a temporary
            m.sync_start(), m.sync_wait(), m.advance()
            fd.sync(stream)
            driver.append(fd.counter("deviceAllocs") - before)
        m.destroy()
        return driver

    def test_a_python_allocator_serves_every_device_buffer(self):
        fd.install()
        a = _CachingAllocator()
        s = fd.new_stream()
        temps = fd.counter("tempAllocs")
        c = scape.Communicator(1, scape.get_unique_id(), 0, device=0, device_allocator=a)
        driver = self._rounds(c, s)
        c.destroy()
        self.assertGreater(a.allocs, 0, "the library did not call the allocator")
        self.assertEqual(a.streams, {s}, "blocks for another stream than the call's")
        self.assertEqual(driver[1:], [0] * (len(driver) - 1), "driver allocations after round 0")
        self.assertEqual(fd.counter("tempAllocs"), temps, "a temporary bypassed the allocator")
        self.assertEqual((a.mismatches, a.live, a.frees), (0, {}, a.allocs))
        a.drain()

    def test_without_a_hook_the_library_pool_keeps_its_memory(self):
        fd.install()
        s = fd.new_stream()
        c = scape.Communicator(1, scape.get_unique_id(), 0, device=0,
                               device_allocator="library")
        driver = self._rounds(c, s)
        c.destroy()
        self.assertEqual(driver[1:], [0] * (len(driver) - 1), "driver allocations after round 0")

    def test_torch_allocator_is_called_with_the_stream(self):
        # torch here has no CUDA: its caching allocator's two entry points are stand-ins over
        # the fake device's memory, which is what TorchAllocator must call.
        import torch
        from unittest import mock

        fd.install()
        calls = []

        def alloc(size, device=None, stream=None):
            calls.append(("alloc", size, device, stream))
            return fd._shim.fakedev_alloc(size)

        def delete(ptr):
            calls.append(("delete", ptr))

        s = fd.new_stream()
        with mock.patch.object(torch.cuda, "caching_allocator_alloc", alloc), \
                mock.patch.object(torch.cuda, "caching_allocator_delete", delete):
            c = scape.Communicator(1, scape.get_unique_id(), 0, device=0, device_allocator="torch")
            self._rounds(c, s, rounds=2)
            c.destroy()
        allocs = [x for x in calls if x[0] == "alloc"]
        self.assertTrue(allocs)
        self.assertEqual({x[3] for x in allocs}, {s})
        self.assertEqual({x[2] for x in allocs}, {0})
        self.assertEqual(len(allocs), len([x for x in calls if x[0] == "delete"]))

    def test_an_allocator_that_raises_fails_the_call(self):
        fd.install()

        class Broken:
            def alloc(self, nbytes, device, stream):
                raise MemoryError("out of memory (test)")

            def free(self, ptr, nbytes, device, stream):
                pass

        c = scape.Communicator(1, scape.get_unique_id(), 0, device=0, device_allocator=Broken())
        m = c.create_mask([100])
        stat = fd.FakeCudaArray(np.ones(100, np.float32), stream=fd.new_stream())
        with self.assertRaises(scape.ScapeSystemError) as e:
            m.select_next_topk(stat, 0.1)
        self.assertIn("deviceAllocator", str(e.exception))
        m.destroy()
        c.destroy()


class DeviceAllocatorChoice(unittest.TestCase):
    def test_choices(self):
        from scape import allocator

        import torch

        self.assertIsNone(allocator.resolve("library"))
        # "auto" picks torch's allocator only where torch's CUDA is available.
        self.assertEqual(allocator.resolve("auto") is None, not torch.cuda.is_available())
        self.assertIsNotNone(allocator.resolve("torch"))
        with self.assertRaises(scape.InvalidArgumentError):
            allocator.resolve("cuda")
        with self.assertRaises(scape.ArgumentTypeError):
            allocator.resolve(object())
