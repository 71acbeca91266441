#!/usr/bin/env python3
"""Step-time model of dense AdamS versus SCAPE (pure arithmetic, no network).

Alpha-beta model of ring collectives over P ranks, link bandwidth B (bytes/s) and per-message
latency a (s):
    all-reduce of S bytes:  2(P-1) a + 2(P-1)/P * S / B
    all-gather of S bytes (all parts together): (P-1) a + (P-1)/P * S / B
One training step (n parameters, fp32 gradients / payload, density d, k = max(1, floor(d n))):
    dense AdamS:  T = compute + allreduce(4 n)
    SCAPE:        T = compute + allreduce(4 k) + pack + max(0, maskSync - compute)
where maskSync = allgather(mask bytes) runs in the background during the next step's compute
(SCAPE's one-step delay), so only its excess beyond the compute phase counts, and pack is the
local gather/scatter of the k values (0 by default: negligible on a GPU). The mask costs
min(bitmap n/8, Elias-Fano k (2 + floor(log2(n/k))) / 8, 32-bit indices 4k) bytes.

    perf/model.py                       the paper's Llama-1.8B setup (assumptions printed)
    perf/model.py --params 1.8e9 --ranks 32 --bw-gbps 200 --lat-us 5 --compute-s 0.25 \\
                  --density 0.01       any other setup
    perf/model.py --local OUT_DIR       this machine: calibrated from a perf/compare_all.sh run
                                        and printed next to what scape-perf measured
    perf/model.py --step-json FILE      the optimizer passes priced from scape-perf --mode step
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import summarize  # noqa: E402  (perf/summarize.py: the JSON loader)

PAPER_SPEEDUP = 3.26  # SCAPE paper: Llama-1.8B, up to 3.26x faster per step than dense AdamS


# ---- the model (pure functions) -------------------------------------------------------------

def ring_allreduce_s(nbytes, ranks, bw, lat):
    """Ring all-reduce (reduce-scatter + all-gather) of nbytes per rank."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * lat + 2.0 * (ranks - 1) / ranks * nbytes / bw


def ring_allgather_s(total_bytes, ranks, bw, lat):
    """Ring all-gather whose result (all ranks' parts together) is total_bytes."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * lat + float(ranks - 1) / ranks * total_bytes / bw


def mask_k(n, density):
    return max(1, int(math.floor(density * n))) if n > 0 else 0


def elias_fano_bytes(n, k):
    """Elias-Fano code of k sorted positions below n: k (L + 2) bits, L = floor(log2(n / k))."""
    if k <= 0:
        return 0.0
    low = max(0, int(math.floor(math.log2(float(n) / k)))) if n > k else 0
    return k * (low + 2) / 8.0


def mask_bytes(n, k, encoding="best"):
    sizes = {"bitmap": n / 8.0, "eliasfano": elias_fano_bytes(n, k), "indices": 4.0 * k}
    if encoding == "best":
        return min(sizes.values())
    return sizes[encoding]


def step_times(params, ranks, bw, lat, compute_s, density, encoding="best", pack_s=0.0,
               value_bytes=4):
    """Returns a dict with the dense AdamS and SCAPE step times and their parts (seconds)."""
    k = mask_k(params, density)
    dense_comm = ring_allreduce_s(value_bytes * params, ranks, bw, lat)
    payload = ring_allreduce_s(value_bytes * k, ranks, bw, lat)
    mbytes = mask_bytes(params, k, encoding)
    sync = ring_allgather_s(mbytes, ranks, bw, lat)
    excess = max(0.0, sync - compute_s)
    dense = compute_s + dense_comm
    scape = compute_s + payload + pack_s + excess
    return {"k": k, "dense_comm_s": dense_comm, "payload_s": payload, "mask_bytes": mbytes,
            "mask_bytes_per_param": mbytes / params if params else 0.0,
            "mask_sync_s": sync, "sync_excess_s": excess, "pack_s": pack_s,
            "dense_step_s": dense, "scape_step_s": scape,
            "speedup": dense / scape if scape > 0 else float("inf")}


def compute_for_speedup(target, params, ranks, bw, lat, density, encoding="best"):
    """The per-step compute time at which the model's speedup equals `target` (bisection);
    None when the target is out of reach."""
    lo, hi = 0.0, 1e4
    if step_times(params, ranks, bw, lat, lo, density, encoding)["speedup"] < target:
        return None
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if step_times(params, ranks, bw, lat, mid, density, encoding)["speedup"] > target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def gather_lines(n, density, line_elems=16):
    """Expected cache lines a gather of a random density-d subset of n fp32 touches."""
    lines = n / float(line_elems)
    return lines * (1.0 - (1.0 - density) ** line_elems)


# ---- reports --------------------------------------------------------------------------------

def paper_report(a):
    bw = a.bw_gbps * 1e9 / 8.0
    lat = a.lat_us * 1e-6
    print("# SCAPE step-time model: %s" % a.label)
    print("# assumptions (not measured): %.3g parameters, %d ranks (one GPU per node), link %g Gb/s "
          "(%.1f GB/s) per rank, latency %g us per message, per-step compute %g s, fp32 gradients "
          "and payload, mask encoding = the smallest of bitmap / Elias-Fano / indices, mask sync "
          "overlapped with compute, ring collectives at full link rate"
          % (a.params, a.ranks, a.bw_gbps, bw / 1e9, a.lat_us, a.compute_s))
    print("# %8s  %10s  %10s  %10s  %10s  %10s  %10s  %8s" %
          ("density", "mask(B/p)", "dense AR", "payload AR", "mask sync", "dense step",
           "SCAPE step", "speedup"))
    for d in a.density:
        s = step_times(a.params, a.ranks, bw, lat, a.compute_s, d, a.encoding)
        print("  %8g  %10.4f  %9.1fms  %9.2fms  %9.2fms  %9.1fms  %9.1fms  %7.2fx" %
              (d, s["mask_bytes_per_param"], s["dense_comm_s"] * 1e3, s["payload_s"] * 1e3,
               s["mask_sync_s"] * 1e3, s["dense_step_s"] * 1e3, s["scape_step_s"] * 1e3,
               s["speedup"]))
    if a.paper:
        d = min(a.density)
        print("# paper (Llama-1.8B, 32 GH200): up to %.2fx per step; model at density %g: %.2fx"
              % (PAPER_SPEEDUP, d,
                 step_times(a.params, a.ranks, bw, lat, a.compute_s, d, a.encoding)["speedup"]))
        c = compute_for_speedup(PAPER_SPEEDUP, a.params, a.ranks, bw, lat, d, a.encoding)
        if c is not None:
            print("# the model gives %.2fx when the per-step compute is %.3f s (the rest of the step "
                  "is the dense all-reduce: %.3f s)" %
                  (PAPER_SPEEDUP, c, ring_allreduce_s(4 * a.params, a.ranks, bw, lat)))
        print("# sensitivity to the assumed compute time (density %g):" % d)
        print("#   %10s  %8s" % ("compute(s)", "speedup"))
        for c in (0.05, 0.1, 0.25, 0.5, 1.0, 2.0):
            print("    %10g  %7.2fx" % (c, step_times(a.params, a.ranks, bw, lat, c, d,
                                                      a.encoding)["speedup"]))


def local_report(out_dir):
    """This machine: the model with (a) the transport's measured loopback bandwidth and latency,
    (b) the bandwidth calibrated from the measured dense all-reduce at the same rank count, plus
    for the dense-in/dense-out form the gather/scatter estimated at the memcpy bandwidth, and
    (c) the same with the gather/scatter times scape-perf measured (scapeMaskPack/Unpack);
    next to scape-perf's measurements (collective only: no compute phase on this machine)."""
    rows, limits = summarize.load(out_dir)  # the same JSON rows the summary reads
    bw_t = limits.get("transport_bw_gbs")
    lat = (limits.get("transport_lat_us") or 0.0) * 1e-6
    mem = limits.get("memcpy_gbs")
    dense, mask, packed = {}, {}, {}
    for r in rows:
        if r.get("impl") != "scape" or not r.get("out_of_place"):
            continue
        if r.get("collective", "allreduce") != "allreduce":
            continue
        key = (r.get("nranks"), round(r.get("density", 1.0), 6))
        if r.get("mode") == "dense":
            dense[r["nranks"]] = r
        elif r.get("mode") == "mask":
            mask[key] = r
        elif r.get("mode") == "mask-packed":
            packed[key] = r
    if not dense:
        print("model: no SCAPE dense all-reduce in %s" % out_dir, file=sys.stderr)
        return 1
    ms = lambda v: "-" if v is None else "%.2fms" % (v * 1e3)
    x = lambda a, b: "-" if (a is None or b is None or b <= 0) else "%.1fx" % (a / b)
    print("# this machine, collective only (no compute phase): model vs scape-perf (out-of-place)")
    print("# (a) alpha-beta with the transport's loopback figures: %s GB/s, %.2f us per message" %
          ("%.2f" % bw_t if bw_t else "-", lat * 1e6))
    print("# (b) bandwidth B_eff fitted to the measured dense all-reduce (same rank count); the "
          "dense-in/out form adds the gather + scatter of the k values (touched 64-B cache lines "
          "+ 8-B indices) at the memcpy bandwidth %s GB/s" % ("%.2f" % mem if mem else "-"))
    print("# (c) as (b), with the gather/scatter times scape-perf measured (scapeMaskPack + "
          "scapeMaskUnpack)")
    print("# %5s  %7s  %-12s  %10s  %10s  %10s  %10s  %9s  %9s  %9s  %9s" %
          ("ranks", "density", "form", "measured", "model (a)", "model (b)", "model (c)",
           "speedup", "(a)", "(b)", "(c)"))
    for p in sorted(dense):
        dr = dense[p]
        n = dr["count"]
        t_dense = dr["out_of_place"]["time_us"] * 1e-6
        fit = t_dense - 2 * (p - 1) * lat
        b_eff = 2.0 * (p - 1) / p * 4 * n / fit if fit > 0 and p > 1 else None
        a_dense = ring_allreduce_s(4 * n, p, bw_t * 1e9, lat) if bw_t else None
        print("  %5d  %7s  %-12s  %10s  %10s  %10s  %10s  %9s  %9s  %9s  %9s" %
              (p, "1", "dense", ms(t_dense), ms(a_dense), ms(t_dense if b_eff else None), "-",
               "1.0x", "1.0x", "1.0x", "-"))
        for d in sorted({k[1] for k in list(mask) + list(packed) if k[0] == p and k[1] < 1.0},
                        reverse=True):
            for form, table in (("dense in/out", mask), ("packed", packed)):
                r = table.get((p, d))
                if r is None:
                    continue
                k = r["k"]
                t_meas = r["out_of_place"]["time_us"] * 1e-6
                a = ring_allreduce_s(4 * k, p, bw_t * 1e9, lat) if bw_t else None
                b = ring_allreduce_s(4 * k, p, b_eff, lat) if b_eff else None
                c = None
                if b is not None and form == "dense in/out":
                    if mem:
                        b_pack = 2 * (gather_lines(n, d) * 64 + 8 * k) / (mem * 1e9)
                        a = a + b_pack if a is not None else None
                        b = b + b_pack
                    if r.get("pack_us") is not None:
                        c = ring_allreduce_s(4 * k, p, b_eff, lat) + \
                            (r["pack_us"] + r["unpack_us"]) * 1e-6
                elif b is not None:
                    c = b
                print("  %5d  %7g  %-12s  %10s  %10s  %10s  %10s  %9s  %9s  %9s  %9s" %
                      (p, d, form, ms(t_meas), ms(a), ms(b), ms(c), x(t_dense, t_meas),
                       x(a_dense, a), x(t_dense, b), x(t_dense, c)))
        if b_eff:
            print("#        (dense all-reduce at %d ranks: B_eff = %.2f GB/s%s)" %
                  (p, b_eff / 1e9, ", %.0f%% of the transport's" % (100 * b_eff / 1e9 / bw_t)
                   if bw_t else ""))
    return 0


def step_report(a):
    """The paper's setup with the optimizer's own passes priced from a scape-perf --mode step
    JSON file (-J): the measured local time per parameter of the SCAPE step (candidate, select,
    norm, update, gather phases: everything but the exchange and the sync wait) and of the dense
    AdamS pass, scaled to --params. Host-memory figures: a GPU runs these passes at HBM speed."""
    import json
    with open(a.step_json) as f:
        rows = json.load(f)
    bw = a.bw_gbps * 1e9 / 8.0
    lat = a.lat_us * 1e-6
    adams = [r for r in rows if r.get("optimizer") == "adams"]
    if not adams:
        print("# %s: no adams row" % a.step_json)
        return 1
    adams_pp = adams[0]["passes_us"] * 1e-6 / adams[0]["count"]
    local = ("candidate", "select", "norm", "update", "gather")
    print("# SCAPE step model with the optimizer passes measured by scape-perf --mode step (%s, %d "
          "ranks, %d parameters): dense AdamS pass %.3f ns/param" %
          (a.step_json, adams[0]["nranks"], adams[0]["count"], adams_pp * 1e9))
    print("# %8s  %12s  %12s  %12s  %10s  (compute %g s, %g parameters, %d ranks, %g Gb/s)" %
          ("density", "scape ns/p", "dense step", "SCAPE step", "speedup", a.compute_s, a.params,
           a.ranks, a.bw_gbps))
    for r in rows:
        if r.get("optimizer") != "scape":
            continue
        d = r["density"]
        pp = sum(r["phases_us"][k] for k in local) * 1e-6 / r["count"]
        s = step_times(a.params, a.ranks, bw, lat, a.compute_s, d, a.encoding)
        dense = s["dense_step_s"] + adams_pp * a.params
        scape = s["scape_step_s"] + pp * a.params
        print("  %8g  %12.3f  %10.1fms  %10.1fms  %9.2fx" %
              (d, pp * 1e9, dense * 1e3, scape * 1e3, dense / scape))
    print("# paper (Llama-1.8B, 32 GH200): up to %.2fx per step" % PAPER_SPEEDUP)
    return 0


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=1.8e9, help="model parameters [1.8e9]")
    ap.add_argument("--ranks", type=int, default=32, help="data-parallel ranks [32]")
    ap.add_argument("--bw-gbps", type=float, default=200.0,
                    help="link bandwidth per rank in Gb/s [200: InfiniBand HDR]")
    ap.add_argument("--lat-us", type=float, default=5.0, help="latency per message, us [5]")
    ap.add_argument("--compute-s", type=float, default=0.25,
                    help="forward + backward + optimizer time per step, s [0.25]")
    ap.add_argument("--density", type=float, nargs="+", default=[0.1, 0.01],
                    help="densities [0.1 0.01]")
    ap.add_argument("--encoding", default="best", choices=["best", "bitmap", "eliasfano", "indices"],
                    help="mask encoding [best]")
    ap.add_argument("--local", metavar="OUT_DIR",
                    help="this machine, from a perf/compare_all.sh results directory")
    ap.add_argument("--step-json", metavar="FILE",
                    help="price the optimizer passes from a scape-perf --mode step -J file")
    a = ap.parse_args(argv)
    for d in a.density:
        if not 0 < d <= 1:
            ap.error("--density %g: expected 0 < density <= 1" % d)
    if a.params <= 0 or a.ranks < 1 or a.bw_gbps <= 0 or a.lat_us < 0 or a.compute_s < 0:
        ap.error("--params, --bw-gbps must be > 0; --ranks >= 1; --lat-us, --compute-s >= 0")
    defaults = (a.params == 1.8e9 and a.ranks == 32 and a.bw_gbps == 200.0 and a.lat_us == 5.0
                and a.compute_s == 0.25)
    a.paper = defaults
    a.label = ("the paper's Llama-1.8B setup" if defaults else "user setup")
    return a


def main(argv):
    a = parse(argv)
    if a.local:
        rc = local_report(a.local)
        print()
        paper_report(a)
        return rc
    paper_report(a)
    if a.step_json:
        print()
        return step_report(a)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
