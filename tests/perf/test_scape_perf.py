#!/usr/bin/env python3
"""Tests of scape-perf's output (and of its peers'): the columns and the JSON are as documented
(scape-perf -h, perf/scape_perf/), #wrong counts real mismatches (SCAPE_PERF_INJECT_ERROR=1
makes rank 0 corrupt one element of each checked result: #wrong > 0 and exit status 2), and bad
flags are clear errors (exit status 64).

    test_scape_perf.py --scape-perf PATH [--gloo PATH] [--mpi PATH] [unittest args, e.g. Format]

Every run is small (64-128 KiB, 2 ranks), so each test class finishes in a few seconds.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

EXE = {"scape": None, "gloo": None, "mpi": None}
RUN_TIMEOUT_S = 25

COLL_MODES = {"dense", "mask", "mask-packed", "coo", "memcpy"}
TYPES = {"float", "half", "bfloat16", "int32", "int64", "f8e4m3", "f8e5m2", "byte"}


def run(args, env_extra=None, exe="scape"):
    env = dict(os.environ)
    env.setdefault("SCAPE_SOCKET_IFNAME", "lo")
    env.setdefault("UCX_NET_DEVICES", "lo")
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    env.pop("SCAPE_PERF_INJECT_ERROR", None)
    if env_extra:
        env.update(env_extra)
    p = subprocess.run([EXE[exe]] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       env=env, timeout=RUN_TIMEOUT_S, universal_newlines=True)
    return p.returncode, p.stdout, p.stderr


def data_lines(out):
    return [l.split() for l in out.splitlines() if l.strip() and not l.startswith("#")]


def num(s):
    return None if s == "N/A" else float(s)


class Format(unittest.TestCase):
    """Columns and JSON of every collective mode, and their agreement."""

    def check_collective(self, args, mode, nranks=2, density_list=(1.0,), inplace=True):
        with tempfile.TemporaryDirectory() as tmp:
            jpath = os.path.join(tmp, "out.json")
            rc, out, err = run(args + ["-J", jpath])
            self.assertEqual(rc, 0, "%s\nstdout:\n%s\nstderr:\n%s" % (args, out, err))
            with open(jpath) as f:
                js = json.load(f)
        # Header: the documented column names, in order.
        names = None
        for l in out.splitlines():
            if l.startswith("#") and "#wrong" in l and "mode" in l:
                names = l[1:].split()
        self.assertEqual(names, ["size", "count", "type", "redop", "root", "time", "algbw", "busbw",
                                 "#wrong", "time", "algbw", "busbw", "#wrong", "mode", "density",
                                 "k", "wire", "oop", "ip"], out)
        self.assertIn("# Out of bounds values : 0 OK", out)
        self.assertIn("# Avg bus bandwidth    : ", out)
        rows = data_lines(out)
        self.assertEqual(len(rows), len(js))
        self.assertGreater(len(rows), 0)
        for f, j in zip(rows, js):
            self.assertEqual(len(f), 19, f)
            size, count = int(f[0]), int(f[1])
            self.assertIn(f[2], TYPES)
            self.assertEqual(int(f[4]), -1)
            self.assertEqual(f[13], mode)
            density, k, wire = float(f[14]), int(f[15]), float(f[16])
            self.assertTrue(0 < density <= 1)
            # out-of-place
            t, alg, bus, wrong = float(f[5]), float(f[6]), float(f[7]), int(f[8])
            self.assertGreater(t, 0)
            self.assertEqual(wrong, 0)
            deq = float(f[17])
            # in-place: numbers, or all N/A when not run
            if inplace:
                self.assertNotEqual(f[9], "N/A")
                self.assertEqual(int(f[12]), 0)
                self.assertNotEqual(f[18], "N/A")
            else:
                self.assertEqual(f[9:13], ["N/A"] * 4)
                self.assertEqual(f[18], "N/A")
            # JSON agrees with the text and with the documented definitions.
            for key in ("impl", "collective", "mode", "nranks", "size", "count", "type", "redop",
                        "root", "density", "k", "wire_bytes", "out_of_place", "in_place"):
                self.assertIn(key, j)
            self.assertEqual(j["impl"], "scape")
            self.assertEqual(j["mode"], mode)
            self.assertEqual(j["nranks"], nranks)
            self.assertEqual((j["size"], j["count"], j["k"]), (size, count, k))
            self.assertAlmostEqual(j["density"], density, places=3)
            self.assertAlmostEqual(j["wire_bytes"], wire, delta=1.0)
            o = j["out_of_place"]
            for key in ("time_us", "algbw_gbs", "busbw_gbs", "deq_bw_gbs", "wrong"):
                self.assertIn(key, o)
            self.assertEqual(o["wrong"], 0)
            sec = o["time_us"] * 1e-6
            self.assertLess(abs(o["time_us"] - t), max(0.01 * t, 1.0))
            # deqbw = dense bytes / time; busbw = wire bytes / time (GB = 1e9)
            self.assertAlmostEqual(o["deq_bw_gbs"], size / 1e9 / sec, delta=0.002 + 1e-3 * deq)
            if mode != "memcpy":
                self.assertAlmostEqual(o["busbw_gbs"], wire / 1e9 / sec,
                                       delta=0.002 + 1e-3 * o["busbw_gbs"])
            self.assertAlmostEqual(deq, o["deq_bw_gbs"], delta=0.006)
            if inplace:
                self.assertIsInstance(j["in_place"], dict)
            else:
                self.assertIsNone(j["in_place"])
        return rows, js

    def test_dense(self):
        rows, js = self.check_collective(["-np", "2", "-b", "64K", "-e", "128K", "-n", "2", "-w", "1"],
                                         "dense")
        self.assertEqual(len(rows), 2)
        for f in rows:
            size = int(f[0])
            self.assertEqual(int(f[15]), int(f[1]))          # k = count
            self.assertAlmostEqual(float(f[16]), size, delta=1)  # 2(P-1)/P * size, P = 2
            self.assertEqual(float(f[14]), 1.0)

    def test_mask(self):
        rows, js = self.check_collective(
            ["-np", "2", "-b", "128K", "-e", "128K", "-n", "2", "-w", "1", "--mode", "mask", "-D", "1,0.1,0.01"],
            "mask")
        self.assertEqual([float(f[14]) for f in rows], [1.0, 0.1, 0.01])
        for f, j in zip(rows, js):
            k, count = int(f[15]), int(f[1])
            d = float(f[14])
            # 5 segments cut by 2 shards: k is about density * count
            self.assertLessEqual(abs(k - d * count), 8)
            self.assertAlmostEqual(float(f[16]), 2 * (2 - 1) / 2 * k * 4, delta=1)
            self.assertIn("mask_total_bytes", j)
            self.assertIn("pack_us", j)

    def test_mask_packed(self):
        rows, js = self.check_collective(
            ["-np", "2", "-b", "128K", "-e", "128K", "-n", "2", "-w", "1", "--mode", "mask-packed", "-D", "0.1"],
            "mask-packed")
        self.assertEqual(len(rows), 1)

    def test_mask_reduce_scatter_and_all_gather(self):
        for coll in ("reducescatter", "allgather"):
            rows, js = self.check_collective(
                ["-np", "2", "-b", "128K", "-e", "128K", "-n", "2", "-w", "0", "--mode", "mask", "-t", coll,
                 "-D", "0.5"], "mask", inplace=False)
            k = int(rows[0][15])
            self.assertAlmostEqual(float(rows[0][16]), (2 - 1) / 2 * k * 4, delta=1)
            self.assertEqual(js[0]["collective"], coll)

    def test_coo(self):
        rows, js = self.check_collective(
            ["-np", "2", "-b", "128K", "-e", "128K", "-n", "2", "-w", "1", "--mode", "coo", "-D", "0.1,0.01"],
            "coo", inplace=False)
        for f, j in zip(rows, js):
            d, count, k = float(f[14]), int(f[1]), int(f[15])
            self.assertLess(abs(k - d * count), 6 * math.sqrt(d * count) + 2)  # mean nnz
            self.assertGreater(float(f[16]), 0)  # the bytes scapeSparseAllReduce reported
            self.assertEqual(j["coo_algo"], "auto")
            self.assertEqual(j["coo_out"], "list")

    def test_coo_allgather_dense_output(self):
        self.check_collective(["-np", "3", "-b", "64K", "-e", "64K", "-n", "1", "-w", "0", "--mode", "coo",
                               "-D", "0.05", "--coo-algo", "allgather", "--coo-out", "dense"],
                              "coo", nranks=3, inplace=False)

    def test_memcpy(self):
        self.check_collective(["-b", "1M", "-e", "1M", "-n", "2", "-w", "1", "--mode", "memcpy"], "memcpy",
                              nranks=1, inplace=False)

    def test_mask_sync(self):
        self.check_mask_sync([], "yield")

    def test_mask_sync_idle_sleep(self):
        self.check_mask_sync(["--idle-wait", "sleep"], "sleep")

    def test_fp8_types_reduce_exactly(self):
        # Issue 33: every collective and the masked all-reduce with the 8-bit floats, values
        # checked (small integers, exact in both formats), 3 ranks (not a power of two).
        for dt in ("f8e4m3", "f8e5m2"):
            for mode, extra in (("dense", ["-t", "allreduce", "-o", "sum"]),
                                ("dense", ["-t", "reducescatter", "-o", "avg"]),
                                ("mask", ["-D", "0.1"])):
                rc, out, err = run(["-np", "3", "-b", "1K", "-e", "64K", "-f", "8", "-n", "2",
                                    "-w", "1", "--mode", mode, "-d", dt] + extra)
                self.assertEqual(rc, 0, f"{dt} {mode} {extra}: " + out + err)
                self.assertIn("# Out of bounds values : 0 OK", out)
                rows = data_lines(out)
                self.assertGreater(len(rows), 0, out)
                for f in rows:
                    self.assertEqual(f[2], dt, f)

    def test_step_fp8_payload_bytes(self):
        # Issue 33: at density 0.01 an e4m3 payload's mask + payload bytes per parameter.
        with tempfile.TemporaryDirectory() as tmp:
            rows = {}
            for dt in ("float", "f8e4m3"):
                jpath = os.path.join(tmp, dt + ".json")
                rc, out, err = run(["-np", "4", "-b", "4M", "-e", "4M", "-n", "2", "-w", "8",
                                    "--mode", "step", "-D", "0.01", "-d", dt, "-J", jpath])
                self.assertEqual(rc, 0, out + err)
                with open(jpath) as f:
                    rows[dt] = [j for j in json.load(f) if j["optimizer"] == "scape"][0]
        b32 = rows["float"]["wire_bytes_per_param"]
        b8 = rows["f8e4m3"]["wire_bytes_per_param"]
        self.assertEqual(rows["f8e4m3"]["bytes_sent"]["payload"] * 4,
                         rows["float"]["bytes_sent"]["payload"])
        self.assertLess(b8, b32)
        self.assertLessEqual(b8, 0.05, rows)

    def test_step(self):
        # --mode step: dense AdamS, dense AdamW, then one SCAPE row per density.
        with tempfile.TemporaryDirectory() as tmp:
            jpath = os.path.join(tmp, "out.json")
            rc, out, err = run(["-np", "2", "-b", "256K", "-e", "256K", "-n", "2", "-w", "2",
                                "--mode", "step", "-D", "1,0.1", "-d", "bfloat16", "-J", jpath])
            self.assertEqual(rc, 0, out + err)
            with open(jpath) as f:
                js = json.load(f)
        rows = data_lines(out)
        self.assertEqual(len(rows), 4, out)
        self.assertEqual(len(js), 4)
        self.assertEqual([r[2] for r in rows], ["adams", "adamw", "scape", "scape"])
        for f, j in zip(rows, js):
            self.assertEqual(len(f), 11, f)
            self.assertEqual(j["mode"], "step")
            self.assertEqual(j["optimizer"], f[2])
            self.assertEqual(j["count"], 65536)
            self.assertEqual(j["payload"], "bfloat16")
            self.assertAlmostEqual(j["out_of_place"]["time_us"], float(f[4]), delta=0.11)
            self.assertGreater(j["floor"]["time_us"], 0.0)
            self.assertGreater(j["floor"]["memcpy_gbps"], 0.0)
            self.assertEqual(int(f[10]), 0)  # parameters identical on both ranks
        scape = [j for j in js if j["optimizer"] == "scape"]
        self.assertEqual([j["density"] for j in scape], [1.0, 0.1])
        for j in scape:
            # The residual and the momentum packed at the mask (whose always-dense segment the
            # row's k leaves out).
            self.assertAlmostEqual(j["state_bytes_per_param"], 4.0 + 4.0 * j["k"] / j["count"],
                                   delta=0.01)
            self.assertEqual(len(j["phases_us"]), 7)
            self.assertGreater(j["bytes_sent"]["payload"], 0)
        self.assertLess(scape[1]["k"], scape[0]["k"])
        self.assertIn("# Out of bounds values : 0 OK", out)

    def check_mask_sync(self, extra, idle_wait):
        with tempfile.TemporaryDirectory() as tmp:
            jpath = os.path.join(tmp, "out.json")
            rc, out, err = run(["-np", "2", "-b", "128K", "-e", "128K", "-n", "2", "-w", "0", "--mask-sync",
                                "-D", "0.1,0.01", "-J", jpath] + extra)
            self.assertEqual(rc, 0, out + err)
            with open(jpath) as f:
                js = json.load(f)
        rows = data_lines(out)
        self.assertEqual(len(rows), 2 * 5)  # two densities x five encodings
        self.assertEqual(len(js), len(rows))
        encs = ["bitmap", "indices", "eliasfano", "deltavarint", "auto"]
        for i, (f, j) in enumerate(zip(rows, js)):
            self.assertEqual(len(f), 19, f)
            self.assertEqual(f[2], encs[i % 5])
            count, density = int(f[0]), float(f[1])
            total = int(f[6])
            self.assertAlmostEqual(float(f[7]), total / count, places=3)  # mask B/param
            self.assertAlmostEqual(float(f[12]), total / count + 8 * density, places=3)
            self.assertEqual(float(f[13]), 8.0)
            self.assertGreater(float(f[9]), 0.0)         # busy phase alone
            self.assertTrue(0.0 <= float(f[11]) <= 1.0)  # hidden fraction
            self.assertEqual(int(f[14]), 0)
            self.assertGreaterEqual(float(f[15]), 0.0)   # sync CPU time
            self.assertGreater(float(f[16]), 0.0)        # idle phase alone
            self.assertTrue(0.0 <= float(f[18]) <= 1.0)  # hidden fraction, idle compute
            for key in ("mask_bytes_per_param", "sync_us", "overlapped_us", "hidden",
                        "mask_plus_payload_bytes_per_param", "sent_bytes", "total_bytes",
                        "encoding", "sent_encoding", "sync_cpu_us", "hidden_idle", "wrong",
                        "busy_alone_us", "idle_alone_us", "idle_overlapped_us"):
                self.assertIn(key, j)
            self.assertEqual(j["mode"], "masksync")
            self.assertEqual(j["idle_wait"], idle_wait)
            # The figures come from the same medians as the columns.
            self.assertAlmostEqual(j["busy_alone_us"], float(f[9]), delta=0.11)
            self.assertAlmostEqual(j["idle_alone_us"], float(f[16]), delta=0.11)
            self.assertEqual(j["encoding"], encs[i % 5])
            if f[2] == "bitmap":  # one bit per element plus the per-part headers
                self.assertLess(abs(total - count / 8), 256)
        self.assertIn("# Out of bounds values : 0 OK", out)


class InjectedErrors(unittest.TestCase):
    """#wrong counts real mismatches: one corrupted element per checked result on rank 0."""

    def expect_wrong(self, args, per_row):
        rc, out, err = run(args, {"SCAPE_PERF_INJECT_ERROR": "1"})
        self.assertEqual(rc, 2, "expected exit status 2 (wrong results)\n" + out + err)
        self.assertRegex(out, r"# Out of bounds values : [1-9][0-9]* FAILED")
        rows = data_lines(out)
        self.assertGreater(len(rows), 0)
        for f in rows:
            self.assertEqual(per_row(f), 1, f)

    def test_dense(self):
        self.expect_wrong(["-np", "2", "-b", "64K", "-e", "64K", "-n", "1", "-w", "0"],
                          lambda f: int(f[8]) if int(f[8]) == int(f[12]) else -1)

    def test_mask(self):
        self.expect_wrong(["-np", "2", "-b", "64K", "-e", "64K", "-n", "1", "-w", "0", "--mode", "mask",
                           "-D", "0.1"], lambda f: int(f[8]) if int(f[8]) == int(f[12]) else -1)

    def test_mask_packed(self):
        self.expect_wrong(["-np", "2", "-b", "64K", "-e", "64K", "-n", "1", "-w", "0", "--mode", "mask-packed",
                           "-D", "0.1", "-I", "0"], lambda f: int(f[8]))

    def test_coo(self):
        self.expect_wrong(["-np", "2", "-b", "64K", "-e", "64K", "-n", "1", "-w", "0", "--mode", "coo",
                           "-D", "0.1"], lambda f: int(f[8]))

    def test_mask_sync(self):
        self.expect_wrong(["-np", "2", "-b", "64K", "-e", "64K", "-n", "1", "-w", "0", "--mask-sync", "-D",
                           "0.1", "--encoding", "eliasfano"], lambda f: int(f[14]))

    def test_clean_run_has_no_wrong(self):
        rc, out, err = run(["-np", "2", "-b", "64K", "-e", "64K", "-n", "1", "-w", "0", "--mode", "mask",
                            "-D", "0.1"])
        self.assertEqual(rc, 0, out + err)
        self.assertIn("# Out of bounds values : 0 OK", out)


class Usage(unittest.TestCase):
    """Bad flags: a clear message naming the flag, exit status 64, no ranks started."""

    def bad(self, args, needle):
        rc, out, err = run(args)
        self.assertEqual(rc, 64, args)
        self.assertIn(needle, err)
        self.assertIn("scape-perf -h", err)

    def test_bad_flags(self):
        self.bad(["--mode", "foo"], "unknown mode 'foo'")
        self.bad(["-D", "0"], "not a density in (0, 1]")
        self.bad(["-D", "0.1,2"], "'2' is not a density")
        self.bad(["--mode", "dense", "-D", "0.1"], "densities apply to --mode mask")
        self.bad(["--mode", "coo", "-d", "int32"], "takes a floating-point type")
        self.bad(["--mode", "coo", "-o", "max"], "takes -o sum or avg")
        self.bad(["--mode", "mask", "-t", "broadcast"], "not broadcast")
        self.bad(["--coo-algo", "rd"], "--coo-algo applies to --mode coo")
        self.bad(["--mode", "coo", "--coo-out", "csr"], "unknown output 'csr'")
        self.bad(["--mode", "mask", "--encoding", "zip"], "unknown encoding 'zip'")
        self.bad(["--mask-sync", "--mode", "mask"], "conflicts")
        self.bad(["-I", "2"], "-I expects 0 or 1")
        self.bad(["--sync-idle", "0"], "--sync-idle applies to --mode masksync")
        self.bad(["--idle-wait", "sleep"], "--idle-wait applies to --mode masksync")
        self.bad(["--mode", "masksync", "--idle-wait", "nap"], "unknown wait 'nap'")
        self.bad(["--mode", "masksync", "--sync-idle", "0", "--idle-wait", "yield"], "no effect")
        self.bad(["--mode", "mask", "--encoding", "bitmap,auto"], "applies to --mode masksync only")
        self.bad(["--bogus"], "unknown argument '--bogus'")

    def test_help_documents_the_columns(self):
        rc, out, err = run(["-h"])
        self.assertEqual(rc, 0)
        for needle in ("--mode", "--density", "--mask-sync", "--coo-algo", "14 mode",
                       "17 wire(B)", "deqbw", "mask+payload"):
            self.assertIn(needle, out)


class Peers(unittest.TestCase):
    """Gloo's and Open MPI's programs print the same columns and JSON rows."""

    def check(self, out, js, impl, nranks):
        rows = data_lines(out)
        self.assertEqual(len(rows), len(js))
        for f, j in zip(rows, js):
            self.assertEqual(len(f), 19, f)
            self.assertEqual(f[13], "dense")
            self.assertEqual(int(f[8]), 0)
            self.assertEqual(j["impl"], impl)
            self.assertEqual(j["nranks"], nranks)
            self.assertEqual(j["size"], int(f[0]))
            self.assertAlmostEqual(j["wire_bytes"], 2 * (nranks - 1) / nranks * j["size"], delta=1)
            self.assertEqual(j["out_of_place"]["wrong"], 0)

    def test_gloo(self):
        if not EXE["gloo"] or not os.path.exists(EXE["gloo"]):
            self.skipTest("gloo-allreduce-perf not built (libgloo-dev missing)")
        with tempfile.TemporaryDirectory() as tmp:
            jpath = os.path.join(tmp, "g.json")
            rc, out, err = run(["-np", "2", "-b", "64K", "-e", "128K", "-n", "2", "-w", "1",
                                "-J", jpath], exe="gloo")
            self.assertEqual(rc, 0, out + err)
            with open(jpath) as f:
                self.check(out, json.load(f), "gloo", 2)

    def test_mpi(self):
        if not EXE["mpi"] or not os.path.exists(EXE["mpi"]) or not shutil.which("mpirun"):
            self.skipTest("mpi-allreduce-perf or mpirun missing")
        with tempfile.TemporaryDirectory() as tmp:
            jpath = os.path.join(tmp, "m.json")
            cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "--mca", "pml", "ob1",
                   "--mca", "btl", "self,vader", "--mca", "oob_tcp_if_include", "lo"]
            if os.geteuid() == 0:
                cmd.append("--allow-run-as-root")
            cmd += ["-np", "2", EXE["mpi"], "-b", "64K", "-e", "128K", "-n", "2", "-w", "1",
                    "-I", "0", "-J", jpath]
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               timeout=RUN_TIMEOUT_S, universal_newlines=True)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            with open(jpath) as f:
                js = json.load(f)
            self.check(p.stdout, js, "mpi", 2)
            for j in js:
                self.assertIsNone(j["in_place"])


class OverlapRepeat(unittest.TestCase):
    """perf/overlap_repeat.sh runs masksync repeatedly and summarises every run."""

    def test_two_runs_summarised(self):
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "perf",
                              "overlap_repeat.sh")
        build = os.path.dirname(os.path.dirname(os.path.abspath(EXE["scape"])))
        env = dict(os.environ, SIZE="128K", REPEATS="2", RANKS="2", DENSITIES="0.1",
                   IDLE_WAIT="yield sleep", PYTHON=sys.executable)
        env.setdefault("SCAPE_SOCKET_IFNAME", "lo")
        env.setdefault("UCX_NET_DEVICES", "lo")
        with tempfile.TemporaryDirectory() as tmp:
            p = subprocess.run(["bash", script, build, tmp], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env, timeout=2 * RUN_TIMEOUT_S,
                               universal_newlines=True)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertEqual(sorted(f for f in os.listdir(tmp) if f.endswith(".json")),
                             ["masksync_np2_d0.1_%s_r%d.json" % (w, r)
                              for w in ("sleep", "yield") for r in (1, 2)])
        summary = p.stdout[p.stdout.index("# mask sync overlap over repeated runs"):]
        rows = data_lines(summary)
        self.assertEqual([f[2] for f in rows], ["sleep", "yield"], p.stdout)
        for f in rows:
            self.assertEqual((f[0], f[1], f[3]), ("2", "0.1", "2"))
            # Each figure is "median [min, max]" (three fields); "runs >= 0.9 / runs" for the
            # busy and the idle phase; then one steal figure per run.
            self.assertEqual((f[11], f[12]), ("/", "2"))
            self.assertEqual((f[17], f[18]), ("/", "2"))
            self.assertEqual(len(f), 21, f)
            self.assertTrue(0.0 <= float(f[13]) <= 1.0, f)  # median hidden (idle)


def main():
    argv = [sys.argv[0]]
    it = iter(sys.argv[1:])
    for a in it:
        if a in ("--scape-perf", "--gloo", "--mpi"):
            EXE[{"--scape-perf": "scape", "--gloo": "gloo", "--mpi": "mpi"}[a]] = next(it, None)
        else:
            argv.append(a)
    if not EXE["scape"]:
        sys.stderr.write("usage: %s --scape-perf PATH [--gloo PATH] [--mpi PATH] [tests]\n"
                         % sys.argv[0])
        return 64
    prog = unittest.main(argv=argv, exit=False)
    return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
