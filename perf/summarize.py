#!/usr/bin/env python3
"""Summary of a perf/compare_all.sh run: one table of every peer, the speedups of SCAPE's masked
all-reduce, the mask-sync figures and the targets of perf/RESULTS.md, met or missed.

    perf/summarize.py OUT_DIR          (the JSON files scape-perf, mpi-allreduce-perf and
                                        gloo-allreduce-perf wrote with -J, plus limits.json)
    perf/summarize.py --json OUT_DIR   the same figures as one JSON object

Times are the out-of-place times (the slowest rank's mean). Standard library only.
"""
import glob
import json
import os
import sys

# The targets (perf/RESULTS.md): (what, ranks, density, threshold).
TARGET_MASK_VS_DENSE_001 = 60.0
TARGET_MASK_VS_COO_001 = 3.0
TARGET_MASK_VS_DENSE_01 = 8.0
TARGET_BYTES_001 = 0.10
TARGET_HIDDEN = 0.90


def load(out_dir):
    rows, limits = [], {}
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print("# summarize: skipping %s: %s" % (path, e), file=sys.stderr)
            continue
        if isinstance(data, dict):
            limits.update(data)
        elif isinstance(data, list):
            rows.extend(r for r in data if isinstance(r, dict))
    for r in rows:
        if r.get("mode") == "memcpy" and r.get("out_of_place"):
            limits["memcpy_gbs"] = r["out_of_place"]["algbw_gbs"]
    return rows, limits


def key_of(r):
    return (r.get("impl"), r.get("mode"), r.get("nranks"), round(float(r.get("density", 1)), 6))


def figures(rows, limits):
    """Everything the summary prints, as plain data."""
    coll = {}
    sync = {}
    for r in rows:
        mode = r.get("mode")
        if mode == "masksync":
            sync[(r["nranks"], round(r["density"], 6), r["encoding"])] = r
        elif mode in ("dense", "mask", "mask-packed", "coo") and r.get("out_of_place"):
            if r.get("collective", "allreduce") != "allreduce":
                continue
            coll[key_of(r)] = r
    ranks = sorted({k[2] for k in coll} | {k[0] for k in sync})
    densities = sorted({k[3] for k in coll if k[1] in ("mask", "mask-packed", "coo")} |
                       {k[1] for k in sync}, reverse=True)

    def t(impl, mode, n, d=1.0):
        r = coll.get((impl, mode, n, round(d, 6)))
        return r["out_of_place"]["time_us"] if r else None

    def ratio(a, b):
        return (a / b) if (a is not None and b is not None and b > 0) else None

    speed = []
    for form, mode in (("dense in/out", "mask"), ("packed", "mask-packed")):
        for n in ranks:
            for d in densities:
                m = t("scape", mode, n, d)
                if m is None:
                    continue
                row = coll.get(("scape", mode, n, round(d, 6))) or {}
                gs = None
                if row.get("pack_us") is not None and row.get("unpack_us") is not None:
                    gs = row["pack_us"] + row["unpack_us"]
                speed.append({
                    "form": form, "nranks": n, "density": d, "mask_us": m,
                    # dense in/out: the speedup over SCAPE dense that the gather + scatter
                    # alone would allow with a free exchange (the memory-latency ceiling)
                    "ceiling_vs_scape_dense": ratio(t("scape", "dense", n), gs),
                    "vs_scape_dense": ratio(t("scape", "dense", n), m),
                    "vs_mpi": ratio(t("mpi", "dense", n), m),
                    "vs_gloo": ratio(t("gloo", "dense", n), m),
                    "vs_coo": ratio(t("scape", "coo", n, d), m),
                })
    syncs = []
    for n in ranks:
        for d in densities:
            r = sync.get((n, d, "auto"))
            if r:
                syncs.append({"nranks": n, "density": d, "sent_encoding": r["sent_encoding"],
                              "mask_bpp": r["mask_bytes_per_param"],
                              "total_bpp": r["mask_plus_payload_bytes_per_param"],
                              "hidden": r["hidden"], "sync_us": r["sync_us"],
                              "sync_cpu_us": r.get("sync_cpu_us"),
                              "hidden_idle": r.get("hidden_idle"),
                              "idle_wait": r.get("idle_wait")})
    enc_order = {"bitmap": 0, "indices": 1, "eliasfano": 2, "deltavarint": 3, "auto": 4}
    by_enc = [dict(r) for r in sorted(sync.values(), key=lambda r: (
        r["nranks"], -r["density"], enc_order.get(r["encoding"], 9)))]

    def find(lst, **kw):
        for x in lst:
            if all(abs(x[k] - v) < 1e-9 if isinstance(v, float) else x[k] == v
                   for k, v in kw.items()):
                return x
        return None

    targets = []

    def target(name, value, threshold, higher_is_better=True, unit="x"):
        if value is None:
            met = None
        else:
            met = value >= threshold if higher_is_better else value <= threshold
        targets.append({"target": name, "value": value, "threshold": threshold,
                        "higher_is_better": higher_is_better, "unit": unit, "met": met})

    for form in ("dense in/out", "packed"):
        s4 = find(speed, form=form, nranks=4, density=0.01) or {}
        target("density 0.01, 4 ranks: masked (%s) vs SCAPE dense all-reduce" % form,
               s4.get("vs_scape_dense"), TARGET_MASK_VS_DENSE_001)
        target("density 0.01, 4 ranks: masked (%s) vs COO sparse all-reduce" % form,
               s4.get("vs_coo"), TARGET_MASK_VS_COO_001)
        for n in ranks:
            s = find(speed, form=form, nranks=n, density=0.1) or {}
            target("density 0.1, %d ranks: masked (%s) vs SCAPE dense all-reduce" % (n, form),
                   s.get("vs_scape_dense"), TARGET_MASK_VS_DENSE_01)
    for n in ranks:
        y = find(syncs, nranks=n, density=0.01) or {}
        target("density 0.01, %d ranks: mask + payload bytes per parameter (auto encoding)" % n,
               y.get("total_bpp"), TARGET_BYTES_001, higher_is_better=False, unit=" B/param")
    for n in ranks:
        for d in densities:
            y = find(syncs, nranks=n, density=d) or {}
            if y:
                target("density %g, %d ranks: mask sync hidden behind equal compute (auto), "
                       "compute busy on the host's cores" % (d, n),
                       y.get("hidden"), TARGET_HIDDEN, unit="")
                if y.get("hidden_idle") is not None and y.get("hidden_idle") >= 0:
                    target("density %g, %d ranks: mask sync hidden behind equal compute (auto), "
                           "host thread waiting for a device (%s)" % (d, n, y.get("idle_wait") or "sleep"),
                           y.get("hidden_idle"), TARGET_HIDDEN, unit="")
    table = []
    mem = limits.get("memcpy_gbs")
    tr = limits.get("transport_bw_gbs")
    order = {"dense": 0, "coo": 1, "mask": 2, "mask-packed": 3}
    for k in sorted(coll, key=lambda k: (k[2], order.get(k[1], 9), k[0], -k[3])):
        r = coll[k]
        o = r["out_of_place"]
        table.append({"nranks": k[2], "impl": k[0], "mode": k[1], "density": k[3],
                      "time_us": o["time_us"], "busbw_gbs": o["busbw_gbs"],
                      "deq_bw_gbs": o.get("deq_bw_gbs", o["algbw_gbs"]),
                      "wire_bytes": r.get("wire_bytes"), "wrong": o.get("wrong"),
                      "frac_transport": (o["busbw_gbs"] / tr) if tr else None,
                      "frac_memcpy": (o["busbw_gbs"] / mem) if mem else None})
    return {"limits": limits, "table": table, "speedups": speed, "mask_sync": syncs,
            "mask_sync_by_encoding": by_enc, "targets": targets}


def fmt(v, spec="%.2f", none="-"):
    return none if v is None else spec % v


def main(argv):
    as_json = "--json" in argv
    args = [a for a in argv if a != "--json"]
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 64
    rows, limits = load(args[0])
    if not rows:
        print("summarize: no results in %s" % args[0], file=sys.stderr)
        return 1
    f = figures(rows, limits)
    if as_json:
        json.dump(f, sys.stdout, indent=1)
        print()
        return 0
    lim = f["limits"]
    print("# limits: memcpy (one rank) %s GB/s; transport (UCX tag, loopback) %s GB/s, latency %s us"
          % (fmt(lim.get("memcpy_gbs")), fmt(lim.get("transport_bw_gbs")),
             fmt(lim.get("transport_lat_us"))))
    print("# all-reduce of the same buffer, out-of-place, slowest rank; busbw = wire bytes per rank"
          " / time; deqbw = dense bytes / time")
    print("# %5s  %-12s  %7s  %11s  %11s  %11s  %13s  %9s  %9s  %6s" %
          ("ranks", "peer", "density", "time(ms)", "busbw(GB/s)", "deqbw(GB/s)", "wire(B/rank)",
           "busbw/tr", "busbw/mem", "#wrong"))
    for r in f["table"]:
        print("  %5d  %-12s  %7g  %11.3f  %11.3f  %11.2f  %13.0f  %9s  %9s  %6s" %
              (r["nranks"], "%s %s" % (r["impl"], r["mode"]), r["density"], r["time_us"] / 1e3,
               r["busbw_gbs"], r["deq_bw_gbs"], r["wire_bytes"] or 0,
               fmt(r["frac_transport"], "%.3f"),
               fmt(r["frac_memcpy"], "%.3f"), r["wrong"]))
    print()
    print("# speedup of SCAPE masked all-reduce (time of the peer / time of masked); dense in/out:"
          " scapeAllReduce with the mask (gather + exchange + scatter); packed: the exchange alone;"
          " ceiling: SCAPE dense / (scapeMaskPack + scapeMaskUnpack), the most the dense in/out"
          " form could reach with a free exchange")
    print("# %-12s  %5s  %7s  %12s  %14s  %10s  %10s  %10s  %8s" %
          ("form", "ranks", "density", "masked(ms)", "vs SCAPE dense", "vs MPI", "vs Gloo",
           "vs COO", "ceiling"))
    for s in f["speedups"]:
        print("  %-12s  %5d  %7g  %12s  %14s  %10s  %10s  %10s  %8s" %
              (s["form"], s["nranks"], s["density"],
               fmt(s["mask_us"] and s["mask_us"] / 1e3, "%.3f"),
               fmt(s["vs_scape_dense"], "%.1fx"), fmt(s["vs_mpi"], "%.1fx"),
               fmt(s["vs_gloo"], "%.1fx"), fmt(s["vs_coo"], "%.1fx"),
               fmt(s.get("ceiling_vs_scape_dense"), "%.1fx")))
    print()
    print("# mask sync per encoding: bytes per parameter per step (dense all-reduce: 8), sync time "
          "alone, fraction hidden behind an equal busy compute phase (fixed work) on the calling "
          "thread, CPU time of the background sync, fraction hidden while the calling thread waits "
          "for a device (polling with sched_yield, or sleeping with --idle-wait sleep)")
    print("# %5s  %7s  %11s  %11s  %12s  %15s  %9s  %7s  %12s  %9s" %
          ("ranks", "density", "encoding", "sent as", "mask(B/par)", "mask+pay(B/par)", "sync(ms)",
           "hidden", "sync-cpu(ms)", "hid-idle"))
    for y in f["mask_sync_by_encoding"]:
        print("  %5d  %7g  %11s  %11s  %12.4f  %15.4f  %9.3f  %7.3f  %12s  %9s" %
              (y["nranks"], y["density"], y["encoding"], y["sent_encoding"],
               y["mask_bytes_per_param"], y["mask_plus_payload_bytes_per_param"],
               y["sync_us"] / 1e3, y["hidden"],
               fmt(y.get("sync_cpu_us") and y["sync_cpu_us"] / 1e3, "%.3f"),
               fmt(y.get("hidden_idle"), "%.3f")))
    print()
    print("# targets")
    for t in f["targets"]:
        state = {True: "MET   ", False: "MISSED", None: "N/A   "}[t["met"]]
        op = ">=" if t["higher_is_better"] else "<="
        val = "-" if t["value"] is None else ("%.3g%s" % (t["value"], t["unit"]))
        print("  [%s] %s: %s (target %s %g%s)" % (state, t["target"], val, op, t["threshold"],
                                                    t["unit"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
