"""One rank of a multi-rank Python test (started by _harness.run_ranks, never by hand).

    rank_worker.py CASE OUTDIR [ARGS...]

Rank and size come from the launcher variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
Inputs are regenerated from seeds on every rank, so each rank checks its own results against
a float64 reference of all ranks' inputs and reports a hash of what it received (the parent
compares the hashes across ranks: results must be bit-identical). The result is written as
JSON to OUTDIR/rank<r>.json; a failed check raises, which exits non-zero.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time

import numpy as np

import scape

RANK = int(os.environ["RANK"])
SIZE = int(os.environ["WORLD_SIZE"])


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        if hasattr(a, "numpy"):
            import torch

            a = a.view(torch.int16).numpy() if a.dtype == torch.bfloat16 else a.numpy()
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def inputs(seed: int, n: int, dtype, rank: int):
    rng = np.random.default_rng(seed * 1000 + rank)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def close(got, want, tol, what):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape} != {want.shape}")
    if got.size and not np.allclose(got, want, rtol=tol, atol=tol):
        i = int(np.argmax(np.abs(got - want)))
        raise AssertionError(f"{what}: element {i}: {got[i]} != {want[i]} (tol {tol})")


def exact(got, want, what):
    if not np.array_equal(np.asarray(got), np.asarray(want)):
        raise AssertionError(f"{what}: differs from the reference")


# ---------------------------------------------------------------------------------------------

def case_collectives(comm, seed="1"):
    import torch

    seed = int(seed)
    hashes = []
    reduce = {"sum": lambda a: a.sum(0), "avg": lambda a: a.sum(0) / SIZE,
              "max": lambda a: a.max(0), "min": lambda a: a.min(0)}
    for n in (0, 1, 7, 1000, 100003):
        for dt in (np.float32, np.int32, np.int64, np.float16):
            allin = np.stack([inputs(seed, n, dt, r) for r in range(SIZE)]).astype(np.float64)
            for op in ("sum", "avg", "max", "min"):
                want = reduce[op](allin)
                if np.issubdtype(dt, np.integer) and op == "avg":
                    want = np.trunc(allin.sum(0) / SIZE)
                x = inputs(seed, n, dt, comm.rank)
                out = np.empty_like(x)
                comm.all_reduce(x, out, op=op)
                tol = 0 if np.issubdtype(dt, np.integer) else (1e-5 if dt == np.float32 else 3e-3 * SIZE)
                if tol == 0:
                    exact(out, want.astype(dt), f"all_reduce {op} {dt.__name__} n={n}")
                else:
                    close(out, want, tol, f"all_reduce {op} {dt.__name__} n={n}")
                # in place on a torch tensor sharing the numpy input's memory (zero-copy)
                t = torch.from_numpy(x.copy())
                comm.all_reduce(t, op=op)
                exact(t.numpy(), out, f"in-place torch all_reduce {op} {dt.__name__} n={n}")
                hashes.append(digest(out))
            # reduce-scatter and all-gather
            x = inputs(seed + 1, n * SIZE, dt, comm.rank)
            allin = np.stack([inputs(seed + 1, n * SIZE, dt, r) for r in range(SIZE)])
            rs = comm.reduce_scatter(x, op="sum")
            want = allin.astype(np.float64).sum(0)[comm.rank * n:(comm.rank + 1) * n]
            if np.issubdtype(dt, np.integer):
                exact(rs, want.astype(dt), f"reduce_scatter {dt.__name__} n={n}")
            else:
                close(rs, want, 1e-5 if dt == np.float32 else 3e-3 * SIZE,
                      f"reduce_scatter {dt.__name__}")
            mine = inputs(seed + 2, n, dt, comm.rank)
            ag = comm.all_gather(mine)
            exact(ag, np.concatenate([inputs(seed + 2, n, dt, r) for r in range(SIZE)]),
                  f"all_gather {dt.__name__} n={n}")
            hashes.append(digest(ag))
            root = SIZE - 1
            b = inputs(seed + 3, n, dt, comm.rank)
            comm.broadcast(b, root=root)
            exact(b, inputs(seed + 3, n, dt, root), f"broadcast {dt.__name__} n={n}")
    # bfloat16 through torch (numpy has no bf16)
    n = 4099
    xs = [torch.from_numpy(inputs(seed + 4, n, np.float32, r)).to(torch.bfloat16)
          for r in range(SIZE)]
    t = xs[comm.rank].clone()
    comm.all_reduce(t, op="sum")
    want = torch.stack(xs).double().sum(0).numpy()
    close(t.float().numpy(), want, 2e-2 * SIZE, "all_reduce bf16")
    hashes.append(digest(t))
    # async forms, several in flight, completed in order
    a = inputs(seed + 5, 5000, np.float32, comm.rank)
    b = inputs(seed + 6, 3000, np.float32, comm.rank)
    ra = comm.all_reduce(a, op="sum", async_op=True)
    rb = comm.all_gather(b, async_op=True)
    rc = comm.barrier(async_op=True)
    while not rc.test():
        pass
    rb.wait()
    ra.wait()
    close(a, np.stack([inputs(seed + 5, 5000, np.float32, r) for r in range(SIZE)])
          .astype(np.float64).sum(0), 1e-5, "async all_reduce")
    exact(rb.result, np.concatenate([inputs(seed + 6, 3000, np.float32, r) for r in range(SIZE)]),
          "async all_gather")
    comm.barrier()
    return {"hash": hashlib.sha256("".join(hashes).encode()).hexdigest()}


def case_unique_id(comm_unused, outdir):
    path = os.path.join(outdir, "uid.bin")
    if RANK == 0:
        uid = scape.get_unique_id()
        with open(path + ".tmp", "wb") as f:
            f.write(bytes(uid))
        os.rename(path + ".tmp", path)
    else:
        deadline = time.monotonic() + 30
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError("no unique id from rank 0")
            time.sleep(0.02)
        with open(path, "rb") as f:
            uid = scape.UniqueId(f.read())
    with scape.Communicator(SIZE, uid, RANK, timeout_ms=15000) as comm:
        assert (comm.rank, comm.size) == (RANK, SIZE)
        x = np.array([RANK + 1], dtype=np.int64)
        comm.all_reduce(x)
        assert int(x[0]) == SIZE * (SIZE + 1) // 2, x
    return {"sum": int(x[0])}


def topk_reference(stat, ranges, offsets, dense, density):
    """This rank's owned part of the next mask, computed independently."""
    sel = []
    for b, e in ranges:
        for s in range(len(offsets) - 1):
            lo, hi = max(b, offsets[s]), min(e, offsets[s + 1])
            if lo >= hi:
                continue
            if dense[s]:
                sel.extend(range(lo, hi))
                continue
            k = max(1, int(np.floor(density * (hi - lo))))
            piece = np.abs(stat[lo:hi].astype(np.float64))
            order = np.argsort(-piece, kind="stable")[:k]
            sel.extend((lo + order).tolist())
    return sorted(sel)


def case_mask(comm, ownership, density, seed="3"):
    density, seed = float(density), int(seed)
    rng = np.random.default_rng(seed)  # same layout on every rank
    lengths = [int(x) for x in rng.integers(0, 3000, 7)] + [0, 1, 517]
    dense = [False] * len(lengths)
    dense[2] = dense[-1] = True
    n = sum(lengths)
    offsets = list(np.concatenate([[0], np.cumsum(lengths)]).astype(int))
    with scape.Mask(comm, lengths, dense=dense, ownership=ownership) as m:
        assert m.n == n and m.count == 0
        # owned ranges: disjoint, cover [0, n), identical view on every rank
        allr = sorted(rg for r in range(SIZE) for rg in m.owned_ranges(r))
        pos = 0
        for b, e in allr:
            assert b == pos and e > b, (allr, n)
            pos = e
        assert pos == n, (allr, n)
        if ownership == "segments":
            assert all(b in offsets and e in offsets for b, e in allr)
        infos = []
        hashes = []
        for step in range(3):
            stat = inputs(seed + 10 + step, n, np.float32, comm.rank)
            m.select_next_topk(stat, density)
            m.sync_start()
            m.sync_wait()
            m.advance()
            # reference: each owner's selection from its own statistic, in mask order (by
            # owner rank, then increasing index)
            want = []
            for r in range(SIZE):
                st = inputs(seed + 10 + step, n, np.float32, r)
                want.extend(topk_reference(st, m.owned_ranges(r), offsets, dense, density))
            got = m.indices()
            exact(got, np.array(want, dtype=np.uint64), f"mask indices step {step}")
            assert m.count == len(want)
            ks = [m.rank_count(r) for r in range(SIZE)]
            assert sum(k for k, _ in ks) == m.count
            assert all(ks[r][1] == sum(k for k, _ in ks[:r]) for r in range(SIZE))
            infos.append(m.sync_info().total_bytes)
            # dense in/out masked all-reduce: masked positions summed, the rest untouched
            g = inputs(seed + 20 + step, n, np.float32, comm.rank)
            out = np.full(n, 7.5, dtype=np.float32)
            comm.all_reduce(g, out, op="sum", mask=m)
            ref = np.full(n, 7.5)
            idx = got.astype(np.int64)
            ref[idx] = np.stack([inputs(seed + 20 + step, n, np.float32, r)[idx]
                                 for r in range(SIZE)]).astype(np.float64).sum(0)
            close(out, ref, 1e-5, "masked all_reduce")
            # packed forms: all-reduce == reduce-scatter + all-gather, bit for bit
            packed = m.pack(g)
            exact(packed, g[idx], "pack")
            ar = m.all_reduce_packed(packed, np.empty_like(packed), op="avg")
            part = m.reduce_scatter(packed, op="avg")
            ag = m.all_gather(part)
            exact(ag, ar, "reduce_scatter + all_gather vs all_reduce_packed")
            back = np.zeros(n, dtype=np.float32)
            m.unpack(ar, back)
            exact(back[idx], ar, "unpack")
            req = m.all_reduce_packed(packed.copy(), op="avg", async_op=True)
            exact(req.wait(), ar, "async all_reduce_packed")
            hashes.append(digest(out, ar))
    return {"hash": hashlib.sha256("".join(hashes).encode()).hexdigest(), "bytes": infos}


def case_sparse(comm, seed="5"):
    seed = int(seed)
    hashes = []
    for n in (1, 1000, 50000):
        for algo in ("auto", "all_gather", "recursive_doubling"):
            for nnz_frac in (0.0, 0.01, 0.3):
                def mine(r):
                    rng = np.random.default_rng(seed * 7 + r + n)
                    k = int(nnz_frac * n)
                    idx = np.sort(rng.choice(n, size=k, replace=False)).astype(np.uint64)
                    return idx, rng.standard_normal(k).astype(np.float32)
                idx, val = mine(comm.rank)
                res = comm.sparse_all_reduce(idx, val, n, op="sum", algo=algo, as_list=True)
                ref = np.zeros(n)
                for r in range(SIZE):
                    i, v = mine(r)
                    np.add.at(ref, i.astype(np.int64), v.astype(np.float64))
                close(res.dense, ref, 1e-5, f"sparse dense n={n} {algo}")
                union = sorted(set(int(j) for r in range(SIZE) for j in mine(r)[0]))
                exact(res.indices, np.array(union, dtype=np.uint64), "sparse union")
                close(res.values, ref[union], 1e-5, "sparse list values")
                hashes.append(digest(res.dense))
    return {"hash": hashlib.sha256("".join(hashes).encode()).hexdigest()}


def case_errors(comm):
    import torch

    # Local argument errors: raised before anything is sent; the communicator stays usable.
    caught = {}
    for name, fn in {
        "noncontig": lambda: comm.all_reduce(torch.zeros(4, 4).t()),
        "dtype": lambda: comm.all_reduce(torch.zeros(4, dtype=torch.float64)),
        "numpy_dtype": lambda: comm.all_reduce(np.zeros(4, dtype=np.uint8)),
        "size": lambda: comm.all_reduce(np.zeros(4, np.float32), np.zeros(5, np.float32)),
        "mixed": lambda: comm.all_reduce(np.zeros(4, np.float32), np.zeros(4, np.float16)),
        "rs_size": lambda: comm.reduce_scatter(np.zeros(4 * SIZE + 1, np.float32)),
        "ag_size": lambda: comm.all_gather(np.zeros(3, np.float32), np.zeros(3, np.float32)),
        "op": lambda: comm.all_reduce(np.zeros(3, np.float32), op="prod"),
        "root": lambda: comm.broadcast(np.zeros(3, np.float32), root=SIZE),
        "not_buffer": lambda: comm.all_reduce([1.0, 2.0]),
        "readonly": lambda: comm.all_reduce(np.broadcast_to(np.zeros(1, np.float32), (4,))),
    }.items():
        try:
            fn()
        except scape.InvalidArgumentError as e:
            caught[name] = [type(e).__name__, e.argument, str(e)]
        else:
            raise AssertionError(f"{name}: no exception")
    x = np.ones(10, np.float32)
    comm.all_reduce(x)
    assert (x == SIZE).all(), "communicator not usable after local argument errors"
    # A cross-rank mismatch reaches the wire: every rank gets an exception with the library's
    # message, and the communicator is broken afterwards.
    bad = np.ones(100 + comm.rank, np.float32)
    try:
        comm.all_reduce(bad)
    except scape.ScapeError as e:
        mismatch = [type(e).__name__, e.code, str(e)]
    else:
        raise AssertionError("mismatched counts did not raise")
    try:
        comm.barrier()
    except scape.ScapeError as e:
        after = [type(e).__name__, str(e)]
    else:
        raise AssertionError("the communicator was usable after a mismatch")
    assert comm.async_error() is not None
    comm.abort()
    return {"caught": caught, "mismatch": mismatch, "after": after}


def case_peer_dies(comm):
    comm.barrier()
    if comm.rank == SIZE - 1:
        os._exit(3)  # dies without telling anyone
    t0 = time.monotonic()
    try:
        comm.all_reduce(np.ones(1 << 16, np.float32))
    except (scape.RemoteError, scape.ScapeTimeoutError) as e:
        err = [type(e).__name__, str(e)]
    else:
        raise AssertionError("a collective with a dead peer succeeded")
    comm.abort()
    return {"error": err, "seconds": time.monotonic() - t0}


def case_abort_thread(comm):
    """Rank 0 blocks in a collective that rank 1 never joins; a watchdog thread aborts it."""
    comm.barrier()
    if comm.rank == 0:
        threading.Timer(1.0, comm.abort).start()
        t0 = time.monotonic()
        try:
            comm.all_reduce(np.ones(1000, np.float32))
        except scape.InvalidUsageError as e:
            err = [type(e).__name__, str(e)]
        else:
            raise AssertionError("the aborted call returned normally")
        dt = time.monotonic() - t0
        try:
            comm.barrier()
        except scape.InvalidUsageError:
            pass
        else:
            raise AssertionError("a call after abort did not raise")
        return {"error": err, "seconds": dt}
    time.sleep(3)
    t0 = time.monotonic()
    try:
        comm.barrier()
    except (scape.RemoteError, scape.ScapeTimeoutError) as e:
        err = [type(e).__name__, str(e)]
    else:
        raise AssertionError("barrier with an aborted peer succeeded")
    comm.abort()
    return {"error": err, "seconds": time.monotonic() - t0}


def case_context_abort(comm):
    """Leaving the with-block by an exception aborts: the peers fail fast, not at timeout."""
    if comm.rank == 0:
        comm.barrier()
        try:
            with comm:
                raise KeyError("user code failed")
        except KeyError:
            pass
        assert not comm.alive
        return {"aborted": True}
    comm.barrier()
    t0 = time.monotonic()
    try:
        comm.all_reduce(np.ones(10, np.float32))
    except (scape.RemoteError, scape.ScapeTimeoutError) as e:
        err = [type(e).__name__, str(e)]
    else:
        raise AssertionError("collective with an aborted peer succeeded")
    comm.abort()
    return {"error": err, "seconds": time.monotonic() - t0}


CASES = {k[5:]: v for k, v in dict(globals()).items() if k.startswith("case_")}


def main() -> int:
    case, outdir, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    if case in ("unique_id",):
        result = CASES[case](None, outdir)
    elif case.startswith("device"):
        import device_worker  # the device path with the fake device (test_device.py)

        result = device_worker.run(case, outdir, args)
    elif case.startswith("optim") or case.startswith("smoke"):
        import optim_worker

        result = optim_worker.run(case, outdir, args)
    else:
        comm = scape.Communicator.from_env()
        assert (comm.rank, comm.size) == (RANK, SIZE)
        result = CASES[case](comm, *args)
        if comm.alive:
            comm.destroy()
    with open(os.path.join(outdir, f"rank{RANK}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.rename(os.path.join(outdir, f"rank{RANK}.json.tmp"),
              os.path.join(outdir, f"rank{RANK}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
