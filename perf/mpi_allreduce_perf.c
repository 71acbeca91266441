/*
 * mpi-allreduce-perf: MPI_Allreduce (float, sum) measured the way scape-perf and nccl-tests
 * measure all-reduce, for side-by-side comparison (perf/compare_mpi.sh, perf/compare_all.sh).
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
 * The options, the columns and the JSON rows are perf/common's (perf/common/perf_common.h), the
 * same as scape-perf's (see scape-perf -h): nccl-tests' 13 columns, then mode ("dense"), density
 * (1), k (count), wire (bytes each rank sends in a ring: 2(n-1)/n * size) and the
 * dense-equivalent bandwidth out-of-place and in-place (size / time). -J writes the same JSON
 * rows as scape-perf with "impl": "mpi". -I 0 skips the in-place half (its columns print N/A).
 * C99; builds with mpicc: mpicc -I. perf/mpi_allreduce_perf.c perf/common/perf_common.c.
 */
#include <errno.h>
#include <inttypes.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "perf/common/perf_common.h"

#define MODE_WIDTH 8 /* the width of the mode column */

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

/* Usage errors: every rank parses the same arguments and leaves with 64; rank 0 reports. */
static void finalize_before_exit(void) { MPI_Finalize(); }

typedef struct options {
  perf_sweep sweep;
  const char* json_path;
} options;

static void on_option(void* ctx, int key, const char* opt, const char* val) {
  options* o = (options*)ctx;
  if (perf_sweep_opt(&o->sweep, key, opt, val)) return;
  switch (key) {
    case 'J':
      if (*val == '\0') perf_usage_error("-J expects a file name");
      o->json_path = val;
      break;
    case 'h':
      if (g_rank == 0) usage(stdout);
      MPI_Finalize();
      exit(0);
    default:
      perf_usage_error("unknown argument '%s'", opt);
  }
}

static void parse_args(int argc, char** argv, options* o) {
  static const perf_opt_spec kSpecs[] = {
      PERF_SWEEP_OPT_SPECS,
      {"-J", "--json", 'J', 1},
      {"-h", "--help", 'h', 0},
  };
  perf_sweep_init(&o->sweep);
  o->json_path = NULL;
  perf_parse_opts(argc, argv, kSpecs, sizeof(kSpecs) / sizeof(kSpecs[0]), on_option, o);
  perf_sweep_finish(&o->sweep, sizeof(float));
  if (o->sweep.max_bytes / sizeof(float) > (uint64_t)2147483647)
    perf_usage_error("-e %" PRIu64 " is more elements than MPI's int count allows",
                     o->sweep.max_bytes);
}

/* The pattern of scape-perf for float sum: base in [0, modulus), partial sums exact. */
static uint32_t g_modulus = 16;
static int64_t value_of(int r, uint64_t j) {
  return (int64_t)(perf_pattern_hash(r, j) % g_modulus);
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

static void mpi_check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    fprintf(stderr, "%s: rank %d: %s failed: %s\n", kProg, g_rank, what, msg);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

static void allreduce(const void* sb, float* recv, uint64_t count) {
  mpi_check(MPI_Allreduce(sb, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
            "MPI_Allreduce");
}

/* One placement: untimed call, barrier, timed calls, optional check. */
static void bench_one(float* send, float* recv, uint64_t count, int in_place, int iters, int check,
                      int rank, int nranks, double* sec, int64_t* wrong) {
  const void* sb = in_place ? MPI_IN_PLACE : (const void*)send;
  float* data = in_place ? recv : send;
  double t0;
  fill(data, count, rank);
  allreduce(sb, recv, count);
  mpi_check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  t0 = MPI_Wtime();
  for (int i = 0; i < iters; ++i) allreduce(sb, recv, count);
  *sec = (MPI_Wtime() - t0) / iters;
  *wrong = 0;
  if (check) {
    fill(data, count, rank);
    if (!in_place) memset(recv, 0xa5, count * sizeof(float));
    allreduce(sb, recv, count);
    *wrong = count_wrong(recv, count, nranks);
  }
}

/* The header: library, sweep, the ranks (gathered to rank 0 in order), the columns. */
static void print_header(const perf_sweep* s, int rank, int nranks) {
  char host[MPI_MAX_PROCESSOR_NAME];
  char lib[MPI_MAX_LIBRARY_VERSION_STRING];
  int host_len = 0, version = 0, subversion = 0, lib_len = 0;
  long long mine[2] = {(long long)getpid(), 0};
  long long* all = NULL;
  char* hosts = NULL;
  char* nl;
  memset(host, 0, sizeof(host));
  MPI_Get_processor_name(host, &host_len);
  MPI_Get_version(&version, &subversion);
  MPI_Get_library_version(lib, &lib_len);
  if ((nl = strchr(lib, '\n')) != NULL) *nl = '\0';
  if ((nl = strchr(lib, ',')) != NULL) *nl = '\0';
  if (rank == 0) {
    printf("# %s: %s (MPI %d.%d), MPI_Allreduce, nranks %d\n", kProg, lib, version, subversion,
           nranks);
    perf_print_sweep_line(stdout, nranks, s);
    printf("#\n# Using ranks\n");
    all = (long long*)malloc(sizeof(long long) * 2 * nranks);
    hosts = (char*)malloc((size_t)MPI_MAX_PROCESSOR_NAME * nranks);
  }
  mpi_check(MPI_Gather(mine, 2, MPI_LONG_LONG, all, 2, MPI_LONG_LONG, 0, MPI_COMM_WORLD),
            "MPI_Gather");
  mpi_check(MPI_Gather(host, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, hosts, MPI_MAX_PROCESSOR_NAME,
                       MPI_CHAR, 0, MPI_COMM_WORLD),
            "MPI_Gather");
  if (rank == 0) {
    for (int r = 0; r < nranks; ++r)
      perf_print_rank_line(stdout, r, all[2 * r], hosts + (size_t)r * MPI_MAX_PROCESSOR_NAME);
    free(all);
    free(hosts);
    printf("#\n");
    perf_print_columns(stdout, MODE_WIDTH);
    fflush(stdout);
  }
}

int main(int argc, char** argv) {
  options o;
  perf_json json = {NULL, 0};
  int json_failed = 0;
  int rank = 0, nranks = 1;
  float *send = NULL, *recv = NULL;
  double bw_sum = 0;
  int bw_count = 0;
  int64_t wrong_total = 0;

  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  g_rank = rank;
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  perf_set_prog(kProg);
  perf_set_usage_error_hooks(rank != 0, finalize_before_exit);
  parse_args(argc, argv, &o);
  const perf_sweep* s = &o.sweep;

  if (o.json_path != NULL && rank == 0) {
    FILE* f = fopen(o.json_path, "w");
    if (f == NULL) {
      fprintf(stderr, "%s: -J: cannot open '%s' for writing: %s\n", kProg, o.json_path,
              strerror(errno));
      MPI_Abort(MPI_COMM_WORLD, PERF_EXIT_USAGE);
    }
    perf_json_open(&json, f);
  }

  g_modulus = perf_float_sum_modulus(nranks);

  send = (float*)malloc(s->max_bytes);
  recv = (float*)malloc(s->max_bytes);
  if (send == NULL || recv == NULL) {
    fprintf(stderr, "%s: rank %d: cannot allocate 2 x %" PRIu64 " bytes\n", kProg, rank,
            s->max_bytes);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  print_header(s, rank, nranks);

  /* Warm-up at the largest and the smallest size, as nccl-tests does. */
  {
    const uint64_t sizes[2] = {s->max_bytes, s->min_bytes};
    for (int k = 0; k < 2; ++k) {
      const uint64_t count = sizes[k] / sizeof(float);
      fill(send, count, rank);
      for (int i = 0; i < s->warmup; ++i) allreduce(send, recv, count);
    }
  }

  for (uint64_t size = s->min_bytes;;) {
    const uint64_t count = size / sizeof(float);
    perf_row row;
    double sec[2] = {0, 0};
    int64_t wrong[2] = {0, 0};
    memset(&row, 0, sizeof(row));
    bench_one(send, recv, count, 0, s->iters, s->check, rank, nranks, &sec[0], &wrong[0]);
    if (s->in_place)
      bench_one(send, recv, count, 1, s->iters, s->check, rank, nranks, &sec[1], &wrong[1]);
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, sec, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD),
              "MPI_Allreduce(time)");
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, wrong, 2, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD),
              "MPI_Allreduce(#wrong)");
    row.bytes = count * sizeof(float);
    row.count = count;
    row.type = "float";
    row.redop = "sum";
    row.root = -1;
    row.mode = "dense";
    row.density = 1.0;
    row.k = count;
    row.wire = 2.0 * (nranks - 1) / nranks * (double)row.bytes;
    for (int k = 0; k < 2; ++k) {
      perf_place* p = &row.place[k];
      if (k == 1 && !s->in_place) continue;
      p->ran = 1;
      p->time_us = sec[k] * 1e6;
      p->algbw = sec[k] > 0 ? (double)row.bytes / 1e9 / sec[k] : 0.0;
      p->busbw = p->algbw * 2.0 * (nranks - 1) / nranks;
      p->deqbw = p->algbw;
      p->wrong = wrong[k];
      bw_sum += p->busbw;
      ++bw_count;
      wrong_total += wrong[k];
    }
    if (rank == 0) {
      perf_print_row(stdout, &row, MODE_WIDTH, s->check);
      fflush(stdout);
    }
    perf_json_row_start(&json);
    perf_json_row_head(&json, "mpi", "allreduce", nranks, &row);
    perf_json_row_tail(&json, &row, s->check);
    if (!perf_sweep_next(s, &size)) break;
  }

  if (rank == 0) {
    perf_print_wrong_footer(stdout, s->check, wrong_total);
    perf_print_summary_line(stdout, "Avg bus bandwidth", bw_count ? bw_sum / bw_count : 0.0);
    printf("#\n");
    fflush(stdout);
  }
  if (json.f != NULL && perf_json_close(&json) != 0) {
    fprintf(stderr, "%s: writing %s failed: %s\n", kProg, o.json_path, strerror(errno));
    json_failed = 1;
  }
  free(send);
  free(recv);
  MPI_Finalize();
  return wrong_total ? PERF_EXIT_WRONG : (json_failed ? 1 : 0);
}
