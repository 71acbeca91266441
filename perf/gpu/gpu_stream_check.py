"""ScapeAdamS on CUDA tensors under torch's current stream (perf/gpu/run.sh's check
"stream-side"; issue 31 item 7, issue 44 item 3): one rank, three runs of the same steps on the
same gradients:

  host:    CPU tensors (the host step);
  default: CUDA tensors on torch's default stream, synchronised after every step;
  side:    CUDA tensors with torch's current stream set to a side stream
           (torch.cuda.stream(side)) for the whole loop, never synchronised inside it: each
           step's gradients are written on the side stream behind a ~20 ms sleep kernel
           (torch.cuda._sleep), then opt.step() is called at once. A library that ran its work
           on another stream, or waited on the wrong one, reads the previous step's gradients
           (or half-written ones) and ends with other bits.

PASS when side ends with the default run's parameters bit for bit (the stream ordering), and
both with the host run's (a 1-rank UCX communicator: the device step gives the host step's
bits; no clipping, whose norm is summed in another order on the device). One line
"PASS stream-side" or "FAIL stream-side: why"; with --json the figures. Needs torch with CUDA
and the scape package built with CUDA; says what is missing otherwise, exit 2.

  python3 perf/gpu/gpu_stream_check.py [--params N] [--steps S] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List


def run(where: str, shapes, grads, steps: int, init) -> Dict[str, Any]:
    import torch

    import scape
    from scape.optim import ScapeAdamS

    cuda = where != "host"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    comm = scape.Communicator(1, scape.get_unique_id(), 0,
                              **({"device": dev.index} if cuda else {}))
    params = [t.clone().to(dev) for t in init]
    G = [[g.to(dev) for g in gs] for gs in grads]
    if cuda:
        torch.cuda.synchronize()
    opt = ScapeAdamS(params, comm, lr=1e-3, density=0.05)
    side = torch.cuda.Stream() if where == "side" else None
    for t in range(steps):
        if side is not None:
            with torch.cuda.stream(side):
                torch.cuda._sleep(20_000_000)  # ~10-20 ms: the gradients land late
                for p, g in zip(params, G[t]):
                    p.grad = torch.empty_like(p)
                    p.grad.copy_(g)
                opt.step()
        else:
            for p, g in zip(params, G[t]):
                p.grad = g.clone()
            opt.step()
            if cuda:
                torch.cuda.synchronize()
    if side is not None:
        side.synchronize()
    out = [p.detach().cpu() for p in params]
    del opt
    comm.destroy()
    return {"params": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("missing: torch")
        return 2
    if not torch.cuda.is_available():
        print("missing: a CUDA device visible to torch (driver, CUDA_VISIBLE_DEVICES)")
        return 2
    try:
        import scape  # noqa: F401
    except ImportError as e:
        print(f"missing: the scape package ({e})")
        return 2
    torch.manual_seed(0)
    shapes = [(a.params // 2 // 1024, 1024), (a.params // 2 // 1024, 1024), (1024,)]
    init = [torch.randn(*s) for s in shapes]
    grads: List[List[Any]] = [[torch.randn(*s) for s in shapes] for _ in range(a.steps)]
    why = []
    res = {}
    for where in ("host", "default", "side"):
        try:
            res[where] = run(where, shapes, grads, a.steps, init)
        except Exception as e:  # this run's failure
            why.append(f"{where}: {type(e).__name__}: {e}")
    figures: Dict[str, Any] = {"params": sum(t.numel() for t in init), "steps": a.steps}
    if "default" in res and "side" in res:
        diff = sum(int((x != y).sum()) for x, y in zip(res["default"]["params"], res["side"]["params"]))
        figures["side_vs_default_elements_differing"] = diff
        if diff:
            why.append(f"side: {diff} parameters differ from the default stream's run")
    if "host" in res:
        for where in ("default", "side"):
            if where not in res:
                continue
            diff = [int((x != y).sum()) for x, y in zip(res["host"]["params"], res[where]["params"])]
            figures[f"{where}_elements_differing"] = sum(diff)
            if sum(diff):
                why.append(f"{where}: {sum(diff)} parameters differ from the host step's")
    ok = not why
    print("PASS stream-side" if ok else "FAIL stream-side: " + "; ".join(why), flush=True)
    if a.json:
        figures["ok"] = ok
        figures["why"] = "; ".join(why)
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
