"""One rank of the Python device-path tests (started through rank_worker.py by
tests/python/test_device.py): the fake device runtime installed into the library, stand-in
CUDA arrays (``__cuda_array_interface__`` and DLPack) over its memory, a communicator of the
requested backend made the requested way, and every device call checked bit for bit against
the same call on host buffers through the same communicator. Values are small integers (exact
in every summation order), so the device results must equal the host ones exactly; the parent
also compares a hash of every rank's results.

Cases: device_coll BACKEND HOW SEED   (BACKEND ucx|nccl; HOW env|pg)
"""
from __future__ import annotations

import hashlib
import os
import time

import numpy as np

import _fakedev as fd
import scape

RANK = int(os.environ["RANK"])
SIZE = int(os.environ["WORLD_SIZE"])


def ints(seed: int, n: int, dtype, rank: int = RANK) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + rank)
    return rng.integers(-100, 101, n).astype(dtype)


def same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
        bad = np.nonzero(got.view(np.uint8) != want.view(np.uint8))[0] if \
            got.nbytes == want.nbytes else []
        raise AssertionError(f"{what}: device result {got[:8]} differs from the host path "
                             f"{want[:8]} (first differing byte {bad[0] if len(bad) else '?'})")


def make_comm(backend: str, how: str) -> scape.Communicator:
    if how == "env":
        return scape.Communicator.from_env(backend=backend)
    if how == "pg":
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=RANK, world_size=SIZE)
        return scape.Communicator.from_process_group(backend=backend)
    raise ValueError(how)


def case_device_coll(backend: str, how: str, seed: str) -> dict:
    seed_i = int(seed)
    nccl = os.environ["SCAPE_TEST_FAKE_NCCL"] if backend == "nccl" else None
    if nccl:
        os.environ["SCAPE_NCCL_LIBRARY"] = nccl
    fd.install(nccl=nccl)
    comm = make_comm(backend, how)
    assert (comm.rank, comm.size) == (RANK, SIZE), (comm.rank, comm.size)
    assert comm.backend == backend, comm.backend
    ncclcalls = None
    if nccl:
        import ctypes

        fl = ctypes.CDLL(nccl)
        fl.fakeNcclCommsLive.restype = ctypes.c_int
        assert fl.fakeNcclCommsLive() == 1, "the library made no NCCL communicator"
        fl.fakeNcclLastCall.restype = ctypes.POINTER(ctypes.c_int * 32)  # FakeNcclCall
        # FakeNcclCall: char fn[32]; 3 pointers/size_t; 3 ints; 2 pointers; int calls
        calls_off = (32 + 8 * 3 + 4 * 3 + 4 + 8 * 2) // 4
        ncclcalls = lambda: fl.fakeNcclLastCall().contents[calls_off]  # noqa: E731
        calls0 = ncclcalls()
    h = hashlib.sha256()
    checked = []
    S = fd.new_stream()
    # fp16 sums: the fake NCCL does not reduce float16 (the UCX path does).
    dtypes = [np.float32, np.int32, np.int64] + ([np.float16] if backend == "ucx" else [])
    for dt in dtypes:
        for n in (1, 1001):
            what = f"all_reduce {np.dtype(dt).name} n={n}"
            x = ints(seed_i + n, n, dt)
            ref = comm.all_reduce(x.copy())
            d = fd.FakeCudaArray(x, stream=S)
            out = fd.FakeCudaArray(np.zeros(n, dt), stream=S)
            assert comm.all_reduce(d, out, op="sum") is out
            same(out.numpy(), ref, what)
            comm.all_reduce(d, op="max")  # in place
            same(d.numpy(), comm.all_reduce(x.copy(), op="max"), what + " max in place")
            h.update(ref.tobytes())
            checked.append(what)
    # reduce-scatter, all-gather, broadcast (float32)
    m = 7
    x = ints(seed_i + 11, m * SIZE, np.float32)
    ref = comm.reduce_scatter(x.copy())
    out = fd.FakeCudaArray(np.zeros(m, np.float32), stream=S)
    # (the inputs stay referenced until their stream is done: the calls return before)
    dsend = fd.FakeCudaArray(x, stream=S)
    comm.reduce_scatter(dsend, out)
    same(out.numpy(), ref, "reduce_scatter")
    x = ints(seed_i + 12, m, np.float32)
    ref = comm.all_gather(x.copy())
    out = fd.FakeCudaArray(np.zeros(m * SIZE, np.float32), stream=S)
    dsend = fd.FakeCudaArray(x, stream=S)
    comm.all_gather(dsend, out)
    same(out.numpy(), ref, "all_gather")
    x = ints(seed_i + 13, 33, np.int32)
    ref = comm.broadcast(x.copy(), root=SIZE - 1)
    d = fd.FakeCudaArray(x, stream=S)
    comm.broadcast(d, root=SIZE - 1)
    same(d.numpy(), ref, "broadcast")
    checked += ["reduce_scatter", "all_gather", "broadcast"]

    # Masks: masked all-reduce (dense in/out), pack / unpack, the packed collectives.
    n = 600
    mask = comm.create_mask([n])
    lo, hi = mask.owned_ranges()[0]
    rng = np.random.default_rng(seed_i * 31 + RANK)
    k = min(hi - lo, 5 + 17 * RANK)
    mask.set_next_indices(np.sort(rng.choice(np.arange(lo, hi, dtype=np.uint64), k,
                                             replace=False)))
    mask.sync_start()
    mask.sync_wait()
    mask.advance()
    x = ints(seed_i + 21, n, np.float32)
    before = ints(seed_i + 22, n, np.float32, rank=0)  # the same on every rank
    ref = before.copy()
    comm.all_reduce(x, ref, mask=mask)
    if ref.tobytes() == before.tobytes():
        raise AssertionError("the host masked all-reduce changed nothing")
    dx = fd.FakeCudaArray(x, stream=S)
    dout = fd.FakeCudaArray(before, stream=S)
    comm.all_reduce(dx, dout, mask=mask)
    same(dout.numpy(), ref, "masked all_reduce")
    # pack / unpack run on the default stream
    kk = mask.count
    pref = mask.pack(x)
    dp = fd.FakeCudaArray(np.zeros(kk, np.float32))
    dxd = fd.FakeCudaArray(x)
    mask.pack(dxd, dp)
    same(dp.numpy(), pref, "pack")
    uref = before.copy()
    mask.unpack(pref, uref)
    du = fd.FakeCudaArray(before)
    mask.unpack(dp, du)
    same(du.numpy(), uref, "unpack")
    aref = mask.all_reduce_packed(pref.copy(), op="sum")
    da = fd.FakeCudaArray(pref, stream=S)
    mask.all_reduce_packed(da, op="sum")
    same(da.numpy(), aref, "all_reduce_packed")
    h.update(ref.tobytes() + aref.tobytes())
    checked += ["masked all_reduce", "pack", "unpack", "all_reduce_packed"]

    # The stream is handed over and the call does not wait for it: with the stream held by a
    # gate, the call returns and the output is still untouched; once the gate opens, the
    # result arrives in stream order.
    S2 = fd.new_stream()
    x = ints(seed_i + 31, 257, np.float32)
    ref = comm.all_reduce(x.copy())
    sentinel = np.full(257, -1234.0, np.float32)
    d = fd.FakeCudaArray(x, stream=S2)
    out = fd.FakeCudaArray(sentinel, stream=S2)
    gate = fd.Gate(S2)
    t0 = time.monotonic()
    comm.all_reduce(d, out)
    returned = time.monotonic() - t0
    peek = np.empty(257, np.float32)
    fd._shim.fakedev_copy(peek.ctypes.data, out.ptr, peek.nbytes)  # default stream: no wait
    held = peek.tobytes() == sentinel.tobytes()
    gate.open()
    same(out.numpy(), ref, "all_reduce behind a held stream")
    if not held:
        raise AssertionError("the all-reduce did not wait for its stream (work was not "
                             "enqueued on the interface's stream)")
    checked.append("stream hand-off")

    # DLPack, bfloat16: the producer is handed the stream (legacy default: 1, torch's CUDA
    # is not in use here) and the result equals the host path on a torch bf16 tensor.
    import torch

    xb = torch.from_numpy(ints(seed_i + 41, 99, np.float32)).to(torch.bfloat16)
    refb = comm.all_reduce(xb.clone())
    dl = fd.FakeDLPack(xb.view(torch.int16).numpy().tobytes(), 99, code=4, bits=16)
    comm.all_reduce(dl)
    got = np.frombuffer(dl.raw(None), np.int16)[:99]
    same(got, refb.view(torch.int16).numpy(), "DLPack bfloat16 all_reduce")
    if dl.streams_seen != [1]:
        raise AssertionError(f"__dlpack__ got streams {dl.streams_seen}, expected [1]")
    h.update(refb.view(torch.int16).numpy().tobytes())
    checked.append("dlpack bf16")

    if ncclcalls is not None and ncclcalls() <= calls0 + 10:
        raise AssertionError(f"only {ncclcalls() - calls0} calls reached the fake NCCL")
    mask.destroy()
    result = {"hash": h.hexdigest(), "checked": checked, "device": comm.device,
              "returned_s": returned}
    comm.destroy()
    if nccl and fl.fakeNcclCommsLive() != 0:
        raise AssertionError("destroy left the NCCL communicator alive")
    return result


def run(case: str, outdir: str, args) -> dict:
    return globals()["case_" + case](*args)
