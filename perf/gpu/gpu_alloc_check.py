"""Device memory per step on a GPU (issue 31 finding 5; perf/gpu/run.sh's check "alloc"):
one rank, ScapeAdamS on CUDA tensors, twice: with the communicator's device memory from torch's
caching allocator (device_allocator="torch", the Python default with CUDA) and from the
library's own pool ("library").

  python3 perf/gpu/gpu_alloc_check.py [--params N] [--steps S] [--json FILE]

What it requires (PASS), after the first step (which allocates the state and the scratch):
  torch:   torch's cudaMalloc count (memory_stats "segment.all.allocated") does not grow,
           and the library's buffers do go through torch (at least one request per step: the
           step's temporaries are requested at every step, counted by a TorchAllocator
           subclass);
  library: the device memory in use outside torch (cudaMemGetInfo less torch's reserved,
           after each synchronised step) is the same after every step, and torch's segments
           do not grow. This shows no growth; it cannot see an allocation made and freed
           within a step (the old per-call cudaMallocAsync returned its memory at the
           synchronisation): that the pool makes none after the first step is what
           tests/device/device_memory_test.cc counts, with the fake runtime.
Then one line per mode, "PASS alloc-<mode>" or "FAIL alloc-<mode>: why", and with --json the
figures. Needs torch with CUDA and the scape package built with CUDA; says what is missing
otherwise and exits 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict


def run_mode(mode: str, n: int, steps: int) -> Dict[str, Any]:
    import torch

    import scape
    from scape.allocator import TorchAllocator
    from scape.optim import ScapeAdamS

    class Counting(TorchAllocator):
        """torch's caching allocator, counting the library's requests."""
        calls = 0

        def alloc(self, nbytes: int, device: int, stream: int) -> int:
            Counting.calls += 1
            return super().alloc(nbytes, device, stream)

    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device())
    comm = scape.Communicator(1, scape.get_unique_id(), 0, device=dev.index,
                              device_allocator=Counting() if mode == "torch" else mode)
    # 4 matrices and a bias: the top-k, the norm (clipping) and the packed exchange all run.
    shapes = [(n // 4 // 1024, 1024)] * 4 + [(1024,)]
    params = [torch.randn(*s, device=dev) for s in shapes]
    opt = ScapeAdamS(params, comm, lr=1e-3, density=0.01, max_grad_norm=1.0)
    segs, calls, used = [], [], []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        torch.cuda.synchronize()
        st = torch.cuda.memory_stats()
        segs.append(int(st.get("segment.all.allocated", 0)))
        calls.append(Counting.calls)
        free, total = torch.cuda.mem_get_info()
        used.append(int(total - free - torch.cuda.memory_reserved()))
    del opt
    comm.destroy()
    r: Dict[str, Any] = {"mode": mode, "params": sum(p.numel() for p in params), "steps": steps,
                         "torch_segments_after_first": segs[-1] - segs[0],
                         "library_allocs_per_step": (calls[-1] - calls[0]) / max(steps - 1, 1),
                         "other_device_bytes_after_first": used[-1] - used[0],
                         "other_device_bytes_range": max(used[1:]) - min(used[1:])
                         if steps > 1 else 0}
    why = []
    if r["torch_segments_after_first"] != 0:
        why.append(f"torch's cudaMalloc count grew by {r['torch_segments_after_first']} after "
                   "the first step")
    if mode == "torch" and r["library_allocs_per_step"] < 1:
        why.append("the library's buffers did not go through torch's allocator")
    if mode == "library" and r["other_device_bytes_range"] != 0:
        why.append(f"device memory outside torch changed by {r['other_device_bytes_range']} B "
                   "between steps")
    r["ok"] = not why
    r["why"] = "; ".join(why)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=16 * 1024 * 1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("missing: torch (pip install torch)")
        return 2
    if not torch.cuda.is_available():
        print("missing: a CUDA device visible to torch (driver, CUDA_VISIBLE_DEVICES)")
        return 2
    try:
        import scape  # noqa: F401
    except ImportError as e:
        print(f"missing: the scape package ({e})")
        return 2
    results = []
    for mode in ("torch", "library"):
        try:
            r = run_mode(mode, a.params, a.steps)
        except Exception as e:  # reported as this mode's failure
            r = {"mode": mode, "ok": False, "why": f"{type(e).__name__}: {e}"}
        results.append(r)
        print(f"PASS alloc-{mode}" if r["ok"] else f"FAIL alloc-{mode}: {r['why']}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
