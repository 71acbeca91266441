/*
 * perf/common: the driver that scape-perf and its peers (gloo-allreduce-perf, mpi-allreduce-perf)
 * share, so that their command lines, their columns and their JSON rows cannot drift apart.
 *
 * Plain C99 (the Open MPI peer is C and builds with mpicc), callable from C++:
 *   - usage errors: perf_set_prog(), perf_usage_error() (exit status 64, "run 'PROG -h'"),
 *   - the option table: perf_parse_opts() ("-b 1M", "-b1M", "--minbytes 1M", "--minbytes=1M")
 *     and the sweep options every program takes (-b -e -f -n -w -c -I): perf_sweep_opt(),
 *   - the sweep itself (perf_sweep_next), the seeded input pattern (perf_pattern_hash),
 *   - the nccl-tests columns (1-13) and scape-perf's columns 14-19: perf_print_columns(),
 *     perf_print_row(); the footer lines; the JSON rows: perf_json_*.
 * Launching local ranks (fork, heartbeats, watchdog) is C++: perf/common/launch.h.
 */
#ifndef SCAPE_PERF_COMMON_PERF_COMMON_H_
#define SCAPE_PERF_COMMON_PERF_COMMON_H_

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PERF_EXIT_OK 0
#define PERF_EXIT_CALL_FAILED 1
#define PERF_EXIT_WRONG 2
#define PERF_EXIT_USAGE 64
#define PERF_EXIT_WATCHDOG 124

#if defined(__GNUC__)
#define PERF_PRINTF(f, a) __attribute__((format(printf, f, a)))
#define PERF_NORETURN __attribute__((noreturn))
#else
#define PERF_PRINTF(f, a)
#define PERF_NORETURN
#endif

/* ---- usage errors --------------------------------------------------------------------------- */

/* The program name of every message ("scape-perf: ..."). */
void perf_set_prog(const char* prog);
const char* perf_prog(void);
/* Usage errors: with quiet set, nothing is printed (MPI: only rank 0 reports); before_exit, when
 * set, runs before exit(PERF_EXIT_USAGE) (MPI: MPI_Finalize). */
void perf_set_usage_error_hooks(int quiet, void (*before_exit)(void));
/* "PROG: <message> (run 'PROG -h' for the options)" on stderr, then exit status 64. */
PERF_NORETURN void perf_usage_error(const char* fmt, ...) PERF_PRINTF(1, 2);

/* "123", "4K", "1M", "2G", "64KB", "1MiB" (1024-based, as nccl-tests); errors name `opt`. */
uint64_t perf_parse_size(const char* opt, const char* s);
/* An integer in [lo, hi]; `what` says what is expected ("a rank count 1..1024"). */
int perf_parse_int(const char* opt, const char* s, long lo, long hi, const char* what);

/* ---- the option table ------------------------------------------------------------------------ */

typedef struct perf_opt_spec {
  const char* short_name; /* "-b"; "" for a long-only option */
  const char* long_name;  /* "--minbytes"; "" for a short-only option */
  int key;                /* passed to the handler */
  int has_arg;
} perf_opt_spec;

/* Called once per option: `opt` is the spelling to name in errors, `val` its value (NULL for an
 * option without one). */
typedef void (*perf_opt_handler)(void* ctx, int key, const char* opt, const char* val);

/* Walks argv[1..argc-1]: "-x VAL", "-xVAL" (a short option with a value, not "--..."),
 * "--long VAL", "--long=VAL". List "-np" before "-n" so that "-np4" is not "-n p4". An argument
 * no spec matches is "unknown argument 'ARG'"; a missing value "OPT expects a value". */
void perf_parse_opts(int argc, char** argv, const perf_opt_spec* specs, size_t nspecs,
                     perf_opt_handler handler, void* ctx);

/* The sweep options every program takes, and their keys. */
typedef struct perf_sweep {
  uint64_t min_bytes, max_bytes, step_factor;
  int iters, warmup, check, in_place;
  int saw_min, saw_max;
} perf_sweep;

#define PERF_OPT_MINBYTES 'b'
#define PERF_OPT_MAXBYTES 'e'
#define PERF_OPT_STEPFACTOR 'f'
#define PERF_OPT_ITERS 'n'
#define PERF_OPT_WARMUP 'w'
#define PERF_OPT_CHECK 'c'
#define PERF_OPT_INPLACE 'I'
/* The specs of the sweep options, to put into a program's table. */
#define PERF_SWEEP_OPT_SPECS                                                                \
  {"-b", "--minbytes", PERF_OPT_MINBYTES, 1}, {"-e", "--maxbytes", PERF_OPT_MAXBYTES, 1},   \
      {"-f", "--stepfactor", PERF_OPT_STEPFACTOR, 1}, {"-n", "--iters", PERF_OPT_ITERS, 1}, \
      {"-w", "--warmup_iters", PERF_OPT_WARMUP, 1}, {"-c", "--check", PERF_OPT_CHECK, 1}, { \
    "-I", "--inplace", PERF_OPT_INPLACE, 1                                                  \
  }

/* Defaults: 32M..32M by 2, 20 iterations, 5 warm-up, check, in place. */
void perf_sweep_init(perf_sweep* s);
/* Handles one of the sweep keys (returns 1), else returns 0. */
int perf_sweep_opt(perf_sweep* s, int key, const char* opt, const char* val);
/* After parsing: a lone -b or -e sets both ends (as nccl-tests); -b >= min_size, -b <= -e. */
void perf_sweep_finish(perf_sweep* s, uint64_t min_size);
/* The sweep: size = -b, then *= -f while it stays <= -e. Returns 0 after the last size. */
int perf_sweep_next(const perf_sweep* s, uint64_t* size);

/* ---- the seeded input -------------------------------------------------------------------- */

/* Rank r's hash at element j; values are hash % modulus (times a scale): the same inputs in
 * scape-perf and its peers. */
uint32_t perf_pattern_hash(int r, uint64_t j);
/* The modulus of float sums over n ranks: every partial sum stays an exact integer in fp32. */
uint32_t perf_float_sum_modulus(int nranks);

/* ---- the columns ------------------------------------------------------------------------------
 */

/* One placement (out of place, in place) of a row. */
typedef struct perf_place {
  int ran;                             /* 0: N/A */
  double time_us, algbw, busbw, deqbw; /* GB/s, GB = 1e9 bytes */
  int64_t wrong;
} perf_place;

/* Columns 1-5 and 14-17 of a row (18-19 are the placements' deqbw). */
typedef struct perf_row {
  uint64_t bytes, count;
  const char* type;
  const char* redop;
  int root;
  const char* mode;
  double density;
  uint64_t k;
  double wire; /* bytes each rank sends */
  perf_place place[2];
} perf_row;

/* "%7.0f" / "%7.1f" / "%7.2f" by magnitude, as nccl-tests. */
void perf_format_time(char* buf, size_t n, double us);
/* The three header lines of columns 1-19; mode_width: the width of the mode column. */
void perf_print_columns(FILE* f, int mode_width);
/* One row; with check 0, #wrong prints N/A. */
void perf_print_row(FILE* f, const perf_row* row, int mode_width, int check);
/* "# nRanks N minBytes ... validation: C" (the second header line of every program). */
void perf_print_sweep_line(FILE* f, int nranks, const perf_sweep* s);
/* "#  Rank  R Pid P on HOST (host memory)". */
void perf_print_rank_line(FILE* f, int rank, long long pid, const char* host);
/* "# Out of bounds values : N OK|FAILED" (or N/A with check 0). */
void perf_print_wrong_footer(FILE* f, int check, int64_t wrong_total);
/* "# LABEL: VALUE " with the label padded as "Out of bounds values " ("Avg bus bandwidth"). */
void perf_print_summary_line(FILE* f, const char* label, double value);

/* ---- the JSON rows ------------------------------------------------------------------------ */

/* An array of rows: "[\n  {...},\n  {...}\n]\n". */
typedef struct perf_json {
  FILE* f; /* NULL: everything is a no-op */
  int rows;
} perf_json;

void perf_json_open(perf_json* j, FILE* f); /* writes "[" */
/* Starts a row: the separator and "  {" (the caller writes the fields). */
void perf_json_row_start(perf_json* j);
/* The fields of a collective row up to "wire_bytes" (no closing brace). */
void perf_json_row_head(perf_json* j, const char* impl, const char* collective, int nranks,
                        const perf_row* row);
/* ", \"out_of_place\": {...}, \"in_place\": {...}" (null where not run), and the closing "}". */
void perf_json_row_tail(perf_json* j, const perf_row* row, int check);
/* Writes the closing "]" (the file stays open). */
void perf_json_end(perf_json* j);
/* perf_json_end, then closes the file; returns 0, or -1 if writing failed (errno set). */
int perf_json_close(perf_json* j);

#ifdef __cplusplus
}
#endif

#endif /* SCAPE_PERF_COMMON_PERF_COMMON_H_ */
