/*
 * mpi-allreduce-perf: MPI_Allreduce (float, sum) measured the way scape-perf and nccl-tests
 * measure all-reduce, for side-by-side comparison (perf/compare_mpi.sh).
 *
 *   mpirun -np N mpi-allreduce-perf -b 1M -e 256M -f 2 [-n 20] [-w 5] [-c 1] [-I 0|1] [-J FILE]
 *
 * Per size: one untimed call, a barrier, -n timed calls (out-of-place, then MPI_IN_PLACE);
 * time is the average per call, maximum over ranks; algbw = bytes / time (GB = 1e9),
 * busbw = algbw * 2(n-1)/n. With -c 1 the inputs are re-initialised, one more call runs and the
 * result is compared exactly against a seeded expectation (small integers, exact in fp32); the
 * wrong-element counts are summed over ranks. Exit status: 0 ok, 1 MPI failure, 2 wrong
 * results, 64 bad command line.
 *
 * Columns are scape-perf's (see scape-perf -h): nccl-tests' 13, then mode ("dense"), density (1),
 * k (count), wire (bytes each rank sends in a ring: 2(n-1)/n * size) and the dense-equivalent
 * bandwidth out-of-place and in-place (size / time). -J writes the same JSON rows as scape-perf
 * with "impl": "mpi". -I 0 skips the in-place half (its columns print N/A).
 */
#include <errno.h>
#include <inttypes.h>
#include <mpi.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXIT_WRONG 2
#define EXIT_USAGE 64

static const char* kProg = "mpi-allreduce-perf";
static int g_rank = 0;

static void usage(FILE* f) {
  fprintf(f,
          "Usage: mpirun -np N %s [options]\n"
          "MPI_Allreduce (float, sum) with nccl-tests columns.\n"
          "  -b SIZE   smallest message in bytes (K/M/G suffixes, 1024-based) [32M]\n"
          "  -e SIZE   largest message in bytes [32M]\n"
          "  -f N      multiply the size by N (integer >= 2) between steps [2]\n"
          "  -n N      timed iterations per size [20]\n"
          "  -w N      warm-up iterations (at the largest and smallest size) [5]\n"
          "  -c 0|1    check results [1]\n"
          "  -I 0|1    also time the in-place form (MPI_IN_PLACE) [1]\n"
          "  -J FILE   also write the results as a JSON array (scape-perf's format)\n"
          "  -h        this text\n",
          kProg);
}

/* Reports a command-line error once (rank 0) and leaves with EXIT_USAGE on every rank (all
 * ranks parse the same arguments, so all reach here). */
static void usage_error(const char* fmt, ...) {
  if (g_rank == 0) {
    va_list ap;
    fprintf(stderr, "%s: ", kProg);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (run '%s -h' for the options)\n", kProg);
  }
  MPI_Finalize();
  exit(EXIT_USAGE);
}

static uint64_t parse_size(const char* opt, const char* s) {
  char* end = NULL;
  unsigned long long v;
  uint64_t mult = 1;
  if (s == NULL || *s == '\0' || *s == '-' || *s == '+')
    usage_error("%s expects a size such as 8, 64K, 1M, 2G, got '%s'", opt, s ? s : "");
  errno = 0;
  v = strtoull(s, &end, 10);
  if (end == s || errno == ERANGE)
    usage_error("%s expects a size such as 8, 64K, 1M, 2G, got '%s'", opt, s);
  switch (*end) {
    case 'k':
    case 'K':
      mult = 1ull << 10;
      ++end;
      break;
    case 'm':
    case 'M':
      mult = 1ull << 20;
      ++end;
      break;
    case 'g':
    case 'G':
      mult = 1ull << 30;
      ++end;
      break;
    default:
      break;
  }
  if (mult > 1 && (strcmp(end, "B") == 0 || strcmp(end, "iB") == 0))
    end += strlen(end);
  else if (mult == 1 && strcmp(end, "B") == 0)
    ++end;
  if (*end != '\0')
    usage_error("%s: unexpected '%s' in size '%s' (suffixes: K, M, G)", opt, end, s);
  if (v > UINT64_MAX / mult) usage_error("%s: size '%s' is too large", opt, s);
  return v * mult;
}

static int parse_int(const char* opt, const char* s, long lo, long hi, const char* what) {
  char* end = NULL;
  long v;
  if (s == NULL || *s == '\0') usage_error("%s expects %s", opt, what);
  errno = 0;
  v = strtol(s, &end, 10);
  if (end == s || *end != '\0' || errno == ERANGE || v < lo || v > hi)
    usage_error("%s expects %s, got '%s'", opt, what, s);
  return (int)v;
}

/* Same pattern as scape-perf for float sum: base in [0, modulus), partial sums exact. */
static uint32_t g_modulus = 16;
static int64_t value_of(int r, uint64_t j) {
  uint32_t h = (uint32_t)j * 2654435761u ^ (uint32_t)(j >> 32) ^ ((uint32_t)r + 1u) * 0x85ebca77u;
  h ^= h >> 15;
  return (int64_t)(h % g_modulus);
}
static int64_t reduced_of(int nranks, uint64_t j) {
  int64_t acc = 0;
  for (int r = 0; r < nranks; ++r) acc += value_of(r, j);
  return acc;
}

static void fill(float* buf, uint64_t count, int rank) {
  for (uint64_t i = 0; i < count; ++i) buf[i] = (float)value_of(rank, i);
}

static int64_t count_wrong(const float* buf, uint64_t count, int nranks) {
  int64_t wrong = 0;
  for (uint64_t i = 0; i < count; ++i) wrong += (double)buf[i] != (double)reduced_of(nranks, i);
  return wrong;
}

static void format_time(char* out, size_t n, double us) {
  if (us >= 10000.0)
    snprintf(out, n, "%7.0f", us);
  else if (us >= 100.0)
    snprintf(out, n, "%7.1f", us);
  else
    snprintf(out, n, "%7.2f", us);
}

static void mpi_check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    fprintf(stderr, "%s: rank %d: %s failed: %s\n", kProg, g_rank, what, msg);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

/* One placement: untimed call, barrier, timed calls, optional check. */
static void bench_one(float* send, float* recv, uint64_t count, int in_place, int iters, int check,
                      int rank, int nranks, double* sec, int64_t* wrong) {
  const void* sb = in_place ? MPI_IN_PLACE : (const void*)send;
  float* data = in_place ? recv : send;
  double t0;
  fill(data, count, rank);
  mpi_check(MPI_Allreduce(sb, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
            "MPI_Allreduce");
  mpi_check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  t0 = MPI_Wtime();
  for (int i = 0; i < iters; ++i)
    mpi_check(MPI_Allreduce(sb, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
              "MPI_Allreduce");
  *sec = (MPI_Wtime() - t0) / iters;
  *wrong = 0;
  if (check) {
    fill(data, count, rank);
    if (!in_place) memset(recv, 0xa5, count * sizeof(float));
    mpi_check(MPI_Allreduce(sb, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
              "MPI_Allreduce");
    *wrong = count_wrong(recv, count, nranks);
  }
}

int main(int argc, char** argv) {
  uint64_t min_bytes = 32ull << 20, max_bytes = 32ull << 20, factor = 2;
  int iters = 20, warmup = 5, check = 1, saw_min = 0, saw_max = 0, in_place = 1;
  const char* json_path = NULL;
  FILE* json = NULL;
  int json_rows = 0, json_failed = 0;
  int rank = 0, nranks = 1;
  float *send = NULL, *recv = NULL;
  double bw_sum = 0;
  int bw_count = 0;
  int64_t wrong_total = 0;
  char host[MPI_MAX_PROCESSOR_NAME];
  int host_len = 0;

  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  g_rank = rank;
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);

  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const char* v;
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      if (rank == 0) usage(stdout);
      MPI_Finalize();
      return 0;
    }
    if (a[0] != '-' || a[1] == '\0' || strchr("befnwcIJ", a[1]) == NULL)
      usage_error("unknown argument '%s'", a);
    if (a[2] != '\0') {
      v = a + 2;
    } else {
      if (i + 1 >= argc) usage_error("%s expects a value", a);
      v = argv[++i];
    }
    switch (a[1]) {
      case 'b':
        min_bytes = parse_size("-b", v);
        saw_min = 1;
        break;
      case 'e':
        max_bytes = parse_size("-e", v);
        saw_max = 1;
        break;
      case 'f':
        factor = (uint64_t)parse_int("-f", v, 2, 1 << 20, "an integer factor >= 2");
        break;
      case 'n':
        iters = parse_int("-n", v, 1, 1 << 30, "an iteration count >= 1");
        break;
      case 'w':
        warmup = parse_int("-w", v, 0, 1 << 30, "a warm-up count >= 0");
        break;
      case 'c':
        check = parse_int("-c", v, 0, 1, "0 or 1");
        break;
      case 'I':
        in_place = parse_int("-I", v, 0, 1, "0 or 1");
        break;
      case 'J':
        if (*v == '\0') usage_error("-J expects a file name");
        json_path = v;
        break;
      default:
        break;
    }
  }
  if (saw_min && !saw_max && max_bytes < min_bytes) max_bytes = min_bytes;
  if (saw_max && !saw_min && min_bytes > max_bytes) min_bytes = max_bytes;
  if (min_bytes < sizeof(float)) usage_error("-b must be at least %zu bytes", sizeof(float));
  if (min_bytes > max_bytes)
    usage_error("-b (%" PRIu64 " bytes) must not exceed -e (%" PRIu64 " bytes)", min_bytes,
                max_bytes);
  if (max_bytes / sizeof(float) > (uint64_t)2147483647)
    usage_error("-e %" PRIu64 " is more elements than MPI's int count allows", max_bytes);

  if (json_path != NULL && rank == 0) {
    json = fopen(json_path, "w");
    if (json == NULL) {
      fprintf(stderr, "%s: -J: cannot open '%s' for writing: %s\n", kProg, json_path,
              strerror(errno));
      MPI_Abort(MPI_COMM_WORLD, EXIT_USAGE);
    }
    fprintf(json, "[\n");
  }

  g_modulus = (uint32_t)((16777216 / nranks < 15 ? 16777216 / nranks : 15) + 1);

  send = (float*)malloc(max_bytes);
  recv = (float*)malloc(max_bytes);
  if (send == NULL || recv == NULL) {
    fprintf(stderr, "%s: rank %d: cannot allocate 2 x %" PRIu64 " bytes\n", kProg, rank, max_bytes);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

  MPI_Get_processor_name(host, &host_len);
  {
    int version = 0, subversion = 0;
    char lib[MPI_MAX_LIBRARY_VERSION_STRING];
    int lib_len = 0;
    char* nl;
    MPI_Get_version(&version, &subversion);
    MPI_Get_library_version(lib, &lib_len);
    if ((nl = strchr(lib, '\n')) != NULL) *nl = '\0';
    if ((nl = strchr(lib, ',')) != NULL) *nl = '\0';
    if (rank == 0) {
      printf("# %s: %s (MPI %d.%d), MPI_Allreduce, nranks %d\n", kProg, lib, version, subversion,
             nranks);
      printf("# nRanks %d minBytes %" PRIu64 " maxBytes %" PRIu64 " step: %" PRIu64
             "(factor) warmup iters: %d iters: %d validation: %d\n",
             nranks, min_bytes, max_bytes, factor, warmup, iters, check);
      printf("#\n# Using ranks\n");
    }
    /* Rank lines, gathered to rank 0 in order. */
    {
      long long mine[2] = {(long long)getpid(), 0};
      long long* all = rank == 0 ? (long long*)malloc(sizeof(long long) * 2 * nranks) : NULL;
      char* hosts = rank == 0 ? (char*)malloc((size_t)MPI_MAX_PROCESSOR_NAME * nranks) : NULL;
      mpi_check(MPI_Gather(mine, 2, MPI_LONG_LONG, all, 2, MPI_LONG_LONG, 0, MPI_COMM_WORLD),
                "MPI_Gather");
      mpi_check(MPI_Gather(host, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, hosts, MPI_MAX_PROCESSOR_NAME,
                           MPI_CHAR, 0, MPI_COMM_WORLD),
                "MPI_Gather");
      if (rank == 0) {
        for (int r = 0; r < nranks; ++r)
          printf("#  Rank %2d Pid %6lld on %10s (host memory)\n", r, all[2 * r],
                 hosts + (size_t)r * MPI_MAX_PROCESSOR_NAME);
        free(all);
        free(hosts);
      }
    }
  }
  if (rank == 0) {
    printf("#\n");
    printf("# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place"
           "          %8s  %7s  %12s  %12s  %7s  %7s\n",
           "", "", "", "", "", "", "", "", "", "deqbw", "deqbw");
    printf("# %10s  %12s  %8s  %6s  %6s", "size", "count", "type", "redop", "root");
    printf("  %7s  %6s  %6s  %6s", "time", "algbw", "busbw", "#wrong");
    printf("  %7s  %6s  %6s  %6s", "time", "algbw", "busbw", "#wrong");
    printf("  %8s  %7s  %12s  %12s  %7s  %7s\n", "mode", "density", "k", "wire", "oop", "ip");
    printf("# %10s  %12s  %8s  %6s  %6s", "(B)", "(elements)", "", "", "");
    printf("  %7s  %6s  %6s  %6s", "(us)", "(GB/s)", "(GB/s)", "");
    printf("  %7s  %6s  %6s  %6s", "(us)", "(GB/s)", "(GB/s)", "");
    printf("  %8s  %7s  %12s  %12s  %7s  %7s\n", "", "", "(elements)", "(B/rank)", "(GB/s)",
           "(GB/s)");
    fflush(stdout);
  }

  /* Warm-up at the largest and the smallest size, as nccl-tests does. */
  {
    const uint64_t sizes[2] = {max_bytes, min_bytes};
    for (int k = 0; k < 2; ++k) {
      const uint64_t count = sizes[k] / sizeof(float);
      fill(send, count, rank);
      for (int i = 0; i < warmup; ++i)
        mpi_check(MPI_Allreduce(send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
                  "MPI_Allreduce");
    }
  }

  for (uint64_t size = min_bytes; size <= max_bytes;) {
    const uint64_t count = size / sizeof(float);
    const uint64_t bytes = count * sizeof(float);
    const double wire = 2.0 * (nranks - 1) / nranks * (double)bytes;
    double sec[2] = {0, 0}, deq[2] = {0, 0}, alg[2] = {0, 0}, bus[2] = {0, 0};
    int64_t wrong[2] = {0, 0};
    bench_one(send, recv, count, 0, iters, check, rank, nranks, &sec[0], &wrong[0]);
    if (in_place) bench_one(send, recv, count, 1, iters, check, rank, nranks, &sec[1], &wrong[1]);
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, sec, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD),
              "MPI_Allreduce(time)");
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, wrong, 2, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD),
              "MPI_Allreduce(#wrong)");
    if (rank == 0)
      printf("%12" PRIu64 "  %12" PRIu64 "  %8s  %6s  %6d", bytes, count, "float", "sum", -1);
    for (int k = 0; k < 2; ++k) {
      const double algbw = sec[k] > 0 ? (double)bytes / 1e9 / sec[k] : 0.0;
      const double busbw = algbw * 2.0 * (nranks - 1) / nranks;
      char t[32], w[32];
      if (k == 1 && !in_place) {
        if (rank == 0) printf("  %7s  %6s  %6s  %6s", "N/A", "N/A", "N/A", "N/A");
        continue;
      }
      alg[k] = algbw;
      bus[k] = busbw;
      deq[k] = algbw;
      format_time(t, sizeof(t), sec[k] * 1e6);
      if (check)
        snprintf(w, sizeof(w), "%" PRId64, wrong[k]);
      else
        snprintf(w, sizeof(w), "N/A");
      if (rank == 0) printf("  %7s  %6.2f  %6.2f  %6s", t, algbw, busbw, w);
      bw_sum += busbw;
      ++bw_count;
      wrong_total += wrong[k];
    }
    if (rank == 0) {
      char ip[32];
      if (in_place)
        snprintf(ip, sizeof(ip), "%7.2f", deq[1]);
      else
        snprintf(ip, sizeof(ip), "%7s", "N/A");
      printf("  %8s  %7.4g  %12" PRIu64 "  %12.0f  %7.2f  %7s\n", "dense", 1.0, count, wire, deq[0],
             ip);
      fflush(stdout);
    }
    if (json != NULL) {
      static const char* kPlace[2] = {"out_of_place", "in_place"};
      fprintf(json,
              "%s  {\"impl\": \"mpi\", \"collective\": \"allreduce\", \"mode\": \"dense\", "
              "\"nranks\": %d, \"size\": %" PRIu64 ", \"count\": %" PRIu64
              ", \"type\": \"float\", \"redop\": \"sum\", \"root\": -1, \"density\": 1, "
              "\"k\": %" PRIu64 ", \"wire_bytes\": %.0f",
              json_rows++ ? ",\n" : "", nranks, bytes, count, count, wire);
      for (int k = 0; k < 2; ++k) {
        if (k == 1 && !in_place) {
          fprintf(json, ", \"%s\": null", kPlace[k]);
          continue;
        }
        fprintf(json,
                ", \"%s\": {\"time_us\": %.3f, \"algbw_gbs\": %.4f, \"busbw_gbs\": %.4f, "
                "\"deq_bw_gbs\": %.4f, ",
                kPlace[k], sec[k] * 1e6, alg[k], bus[k], deq[k]);
        if (check)
          fprintf(json, "\"wrong\": %" PRId64 "}", wrong[k]);
        else
          fprintf(json, "\"wrong\": null}");
      }
      fprintf(json, "}");
      fflush(json);
    }
    if (size > max_bytes / factor) break;
    size *= factor;
  }

  if (rank == 0) {
    if (check)
      printf("# Out of bounds values : %" PRId64 " %s\n", wrong_total,
             wrong_total ? "FAILED" : "OK");
    else
      printf("# Out of bounds values : N/A (-c 0)\n");
    printf("# Avg bus bandwidth    : %g \n", bw_count ? bw_sum / bw_count : 0.0);
    printf("#\n");
    fflush(stdout);
  }
  if (json != NULL) {
    fprintf(json, "\n]\n");
    if (fclose(json) != 0) {
      fprintf(stderr, "%s: writing %s failed: %s\n", kProg, json_path, strerror(errno));
      json_failed = 1;
    }
  }
  free(send);
  free(recv);
  MPI_Finalize();
  return wrong_total ? EXIT_WRONG : (json_failed ? 1 : 0);
}
