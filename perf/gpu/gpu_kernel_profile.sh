#!/usr/bin/env bash
# perf/gpu/gpu_kernel_profile.sh: where the CUDA kernels' time goes, kernel by kernel, with Nsight
# Compute (ncu; needs a GPU machine whose ncu can read the hardware counters).
#
#   bash perf/gpu/gpu_kernel_profile.sh BENCH [N] [REGEX]
#
# Runs BENCH (scape_kernels_gpu_bench, from a build or perf/gpu/gpu_bundle.sh's bundle) on N
# floats (default 67108864) with one timed call per kernel (plus its 3 warm-ups), profiles the
# kernels whose name matches REGEX (default: the top-k passes, the step kernels, gather and
# scatter), and prints one row per kernel name: launches, mean GPU time, mean DRAM bytes read
# and written per launch. The clocks are left as they are (--clock-control none), as in the
# benchmark. Times are per launch: a call of a multi-kernel operation (top-k) is the sum of its
# kernels' rows divided by the calls (4 per configuration). EXTRA_METRICS (comma-separated ncu
# metric names) adds columns, e.g. achieved occupancy and long-scoreboard stalls:
#   EXTRA_METRICS=sm__warps_active.avg.pct_of_peak_sustained_active,\
#     smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct bash perf/gpu/gpu_kernel_profile.sh ...
set -uo pipefail
bench=${1:?usage: gpu_kernel_profile.sh BENCH [N] [REGEX]}
n=${2:-67108864}
regex=${3:-Topk|Setup|TileSeg|Hist|FindBin|CandPlan|Collect|CandHist|CandCount|Count|Scan|Write|Sample|List|Unpack|Candidate|Gather|Scatter}
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu_bin" ] || { echo "no ncu on this machine"; exit 1; }
csv=$(mktemp)
"$ncu_bin" --clock-control none --replay-mode application -k "regex:$regex" \
  --metrics "gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum${EXTRA_METRICS:+,$EXTRA_METRICS}" --csv \
  "$bench" "$n" 1 >"$csv" 2>"$csv.err"
rc=$?
[ $rc -eq 0 ] || { echo "ncu failed ($rc):"; tail -20 "$csv.err"; tail -5 "$csv"; exit 1; }
python3 - "$csv" "${EXTRA_METRICS:-}" <<'EOF'
import collections, csv, re, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]
col = {k: head.index(k) for k in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
         "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6,
         "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3,
         "B": 1e-6, "KB": 1e-3, "MB": 1.0, "GB": 1e3}
per = collections.defaultdict(lambda: collections.defaultdict(dict))
names = {}
for r in rows[1:]:
    i = int(r[col["ID"]])
    full = re.sub(r"\(anonymous namespace\)::", "", r[col["Kernel Name"]])
    names[i] = full.split("(")[0].split("<")[0].split()[-1].split("::")[-1]
    v = float(r[col["Metric Value"]].replace(",", "")) * scale.get(r[col["Metric Unit"]], 1.0)
    per[i][r[col["Metric Name"]]] = v
# Top-k calls start with SetupKernel; the benchmark makes 4 calls (3 warm-ups + 1) per
# configuration, in its table's order: configuration c = call // 4.
topk = set("SetupKernel TileSegKernel HistKernel FindBinKernel CandPlanKernel CollectKernel "
           "CandHistKernel CandCountKernel CountKernel ScanKernel WriteKernel SampleSelectKernel "
           "ListWriteKernel SampledCollectKernel".split())
groups = collections.OrderedDict()
call = -1
for i in sorted(names):
    k = names[i]
    if k == "SetupKernel":
        call += 1
    key = f"top-k config {call // 4}: {k}" if k in topk and call >= 0 else k
    groups.setdefault(key, []).append(per[i])
print("top-k configurations in the benchmark's order: 0 exact 1 seg, 1 sampled 1 seg, "
      "2 exact 1024 seg, 3 sampled 1024 seg")
extra = [m for m in sys.argv[2].split(",") if m]
print(f"{'kernel':44s} {'launches':>8s} {'us/launch':>10s} {'MB read':>9s} {'MB written':>10s}"
      + "".join(f" {m[:24]:>24s}" for m in extra))
for k, ms in groups.items():
    c = len(ms)
    t = sum(m.get("gpu__time_duration.sum", 0) for m in ms) / c
    rd = sum(m.get("dram__bytes_read.sum", 0) for m in ms) / c
    wr = sum(m.get("dram__bytes_write.sum", 0) for m in ms) / c
    ex = "".join(f" {sum(m.get(e, 0) for m in ms) / c:24.1f}" for e in extra)
    print(f"{k:44s} {c:8d} {t:10.1f} {rd:9.1f} {wr:10.1f}{ex}")
EOF
rm -f "$csv" "$csv.err"
