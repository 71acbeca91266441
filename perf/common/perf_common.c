/* perf/common: the shared driver of scape-perf and its peers (see perf_common.h). */
#include "perf/common/perf_common.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

static const char* g_prog = "perf";
static int g_quiet = 0;
static void (*g_before_exit)(void) = NULL;

void perf_set_prog(const char* prog) { g_prog = prog; }
const char* perf_prog(void) { return g_prog; }

void perf_set_usage_error_hooks(int quiet, void (*before_exit)(void)) {
  g_quiet = quiet;
  g_before_exit = before_exit;
}

void perf_usage_error(const char* fmt, ...) {
  if (!g_quiet) {
    va_list ap;
    fprintf(stderr, "%s: ", g_prog);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (run '%s -h' for the options)\n", g_prog);
  }
  if (g_before_exit != NULL) g_before_exit();
  exit(PERF_EXIT_USAGE);
}

uint64_t perf_parse_size(const char* opt, const char* s) {
  char* end = NULL;
  unsigned long long v;
  uint64_t mult = 1;
  if (s == NULL || *s == '\0') perf_usage_error("%s expects a size such as 8, 64K, 1M, 2G", opt);
  if (*s == '-' || *s == '+') perf_usage_error("%s expects a non-negative size, got '%s'", opt, s);
  errno = 0;
  v = strtoull(s, &end, 10);
  if (end == s || errno == ERANGE)
    perf_usage_error("%s expects a size such as 8, 64K, 1M, 2G, got '%s'", opt, s);
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
    perf_usage_error("%s: unexpected '%s' in size '%s' (suffixes: K, M, G)", opt, end, s);
  if (v > UINT64_MAX / mult) perf_usage_error("%s: size '%s' is too large", opt, s);
  return v * mult;
}

int perf_parse_int(const char* opt, const char* s, long lo, long hi, const char* what) {
  char* end = NULL;
  long v;
  if (s == NULL || *s == '\0') perf_usage_error("%s expects %s", opt, what);
  errno = 0;
  v = strtol(s, &end, 10);
  if (end == s || *end != '\0' || errno == ERANGE || v < lo || v > hi)
    perf_usage_error("%s expects %s, got '%s'", opt, what, s);
  return (int)v;
}

/* ---- the option table ---------------------------------------------------------------------- */

/* The spec `a` names, and its value; NULL when none does. *i advances past a separate value. */
static const perf_opt_spec* match_opt(int argc, char** argv, int* i, const perf_opt_spec* specs,
                                      size_t nspecs, const char** opt, const char** val) {
  const char* a = argv[*i];
  for (size_t n = 0; n < nspecs; ++n) {
    const perf_opt_spec* s = &specs[n];
    const size_t sl = strlen(s->short_name), ll = strlen(s->long_name);
    if ((sl > 0 && strcmp(a, s->short_name) == 0) || (ll > 0 && strcmp(a, s->long_name) == 0)) {
      *opt = a;
      if (s->has_arg) {
        if (*i + 1 >= argc) perf_usage_error("%s expects a value", a);
        *val = argv[++*i];
      }
      return s;
    }
    if (ll > 0 && s->has_arg && strncmp(a, s->long_name, ll) == 0 && a[ll] == '=') {
      *opt = s->long_name;
      *val = a + ll + 1;
      return s;
    }
    if (sl > 0 && s->has_arg && strncmp(a, s->short_name, sl) == 0 && a[sl] != '\0' &&
        a[1] != '-') {
      *opt = s->short_name;
      *val = a + sl;
      return s;
    }
  }
  return NULL;
}

void perf_parse_opts(int argc, char** argv, const perf_opt_spec* specs, size_t nspecs,
                     perf_opt_handler handler, void* ctx) {
  for (int i = 1; i < argc; ++i) {
    const char* opt = NULL;
    const char* val = NULL;
    const char* a = argv[i];
    const perf_opt_spec* s = match_opt(argc, argv, &i, specs, nspecs, &opt, &val);
    if (s == NULL) perf_usage_error("unknown argument '%s'", a);
    handler(ctx, s->key, opt, val);
  }
}

void perf_sweep_init(perf_sweep* s) {
  memset(s, 0, sizeof(*s));
  s->min_bytes = 32ull << 20;
  s->max_bytes = 32ull << 20;
  s->step_factor = 2;
  s->iters = 20;
  s->warmup = 5;
  s->check = 1;
  s->in_place = 1;
}

int perf_sweep_opt(perf_sweep* s, int key, const char* opt, const char* val) {
  switch (key) {
    case PERF_OPT_MINBYTES:
      s->min_bytes = perf_parse_size(opt, val);
      s->saw_min = 1;
      return 1;
    case PERF_OPT_MAXBYTES:
      s->max_bytes = perf_parse_size(opt, val);
      s->saw_max = 1;
      return 1;
    case PERF_OPT_STEPFACTOR:
      s->step_factor = (uint64_t)perf_parse_int(opt, val, 2, 1 << 20, "an integer factor >= 2");
      return 1;
    case PERF_OPT_ITERS:
      s->iters = perf_parse_int(opt, val, 1, 1 << 30, "an iteration count >= 1");
      return 1;
    case PERF_OPT_WARMUP:
      s->warmup = perf_parse_int(opt, val, 0, 1 << 30, "a warm-up count >= 0");
      return 1;
    case PERF_OPT_CHECK:
      s->check = perf_parse_int(opt, val, 0, 1, "0 or 1");
      return 1;
    case PERF_OPT_INPLACE:
      s->in_place = perf_parse_int(opt, val, 0, 1, "0 or 1");
      return 1;
    default:
      return 0;
  }
}

void perf_sweep_finish(perf_sweep* s, uint64_t min_size) {
  if (s->saw_min && !s->saw_max && s->max_bytes < s->min_bytes) s->max_bytes = s->min_bytes;
  if (s->saw_max && !s->saw_min && s->min_bytes > s->max_bytes) s->min_bytes = s->max_bytes;
  if (s->min_bytes < min_size) {
    if (min_size == 1) perf_usage_error("-b must be at least 1 byte");
    perf_usage_error("-b must be at least %" PRIu64 " bytes", min_size);
  }
  if (s->min_bytes > s->max_bytes)
    perf_usage_error("-b (%" PRIu64 " bytes) must not exceed -e (%" PRIu64 " bytes)", s->min_bytes,
                     s->max_bytes);
}

int perf_sweep_next(const perf_sweep* s, uint64_t* size) {
  if (*size > s->max_bytes / s->step_factor) return 0;
  *size *= s->step_factor;
  return 1;
}

/* ---- the seeded input ---------------------------------------------------------------------- */

uint32_t perf_pattern_hash(int r, uint64_t j) {
  uint32_t h = (uint32_t)j * 2654435761u ^ (uint32_t)(j >> 32) ^ ((uint32_t)r + 1u) * 0x85ebca77u;
  h ^= h >> 15;
  return h;
}

uint32_t perf_float_sum_modulus(int nranks) {
  const int64_t lim = 16777216 / nranks; /* 2^24: every integer up to it is exact in fp32 */
  return (uint32_t)((lim < 15 ? lim : 15) + 1);
}

/* ---- the columns ----------------------------------------------------------------------------- */

void perf_format_time(char* buf, size_t n, double us) {
  if (us >= 10000.0)
    snprintf(buf, n, "%7.0f", us);
  else if (us >= 100.0)
    snprintf(buf, n, "%7.1f", us);
  else
    snprintf(buf, n, "%7.2f", us);
}

void perf_print_columns(FILE* f, int mw) {
  fprintf(f,
          "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place"
          "          %*s  %7s  %12s  %12s  %7s  %7s\n",
          "", "", "", "", "", mw, "", "", "", "", "deqbw", "deqbw");
  fprintf(f, "# %10s  %12s  %8s  %6s  %6s", "size", "count", "type", "redop", "root");
  fprintf(f, "  %7s  %6s  %6s  %6s", "time", "algbw", "busbw", "#wrong");
  fprintf(f, "  %7s  %6s  %6s  %6s", "time", "algbw", "busbw", "#wrong");
  fprintf(f, "  %*s  %7s  %12s  %12s  %7s  %7s\n", mw, "mode", "density", "k", "wire", "oop", "ip");
  fprintf(f, "# %10s  %12s  %8s  %6s  %6s", "(B)", "(elements)", "", "", "");
  fprintf(f, "  %7s  %6s  %6s  %6s", "(us)", "(GB/s)", "(GB/s)", "");
  fprintf(f, "  %7s  %6s  %6s  %6s", "(us)", "(GB/s)", "(GB/s)", "");
  fprintf(f, "  %*s  %7s  %12s  %12s  %7s  %7s\n", mw, "", "", "(elements)", "(B/rank)", "(GB/s)",
          "(GB/s)");
}

void perf_print_row(FILE* f, const perf_row* w, int mw, int check) {
  char ip[32];
  fprintf(f, "%12" PRIu64 "  %12" PRIu64 "  %8s  %6s  %6d", w->bytes, w->count, w->type, w->redop,
          w->root);
  for (int k = 0; k < 2; ++k) {
    char t[32], wr[32];
    if (!w->place[k].ran) {
      fprintf(f, "  %7s  %6s  %6s  %6s", "N/A", "N/A", "N/A", "N/A");
      continue;
    }
    perf_format_time(t, sizeof(t), w->place[k].time_us);
    if (check)
      snprintf(wr, sizeof(wr), "%" PRId64, w->place[k].wrong);
    else
      snprintf(wr, sizeof(wr), "N/A");
    fprintf(f, "  %7s  %6.2f  %6.2f  %6s", t, w->place[k].algbw, w->place[k].busbw, wr);
  }
  if (w->place[1].ran)
    snprintf(ip, sizeof(ip), "%7.2f", w->place[1].deqbw);
  else
    snprintf(ip, sizeof(ip), "%7s", "N/A");
  fprintf(f, "  %*s  %7.4g  %12" PRIu64 "  %12.0f  %7.2f  %7s\n", mw, w->mode, w->density, w->k,
          w->wire, w->place[0].deqbw, ip);
}

void perf_print_sweep_line(FILE* f, int nranks, const perf_sweep* s) {
  fprintf(f,
          "# nRanks %d minBytes %" PRIu64 " maxBytes %" PRIu64 " step: %" PRIu64
          "(factor) warmup iters: %d iters: %d validation: %d\n",
          nranks, s->min_bytes, s->max_bytes, s->step_factor, s->warmup, s->iters, s->check);
}

void perf_print_rank_line(FILE* f, int rank, long long pid, const char* host) {
  fprintf(f, "#  Rank %2d Pid %6lld on %10s (host memory)\n", rank, pid, host);
}

void perf_print_wrong_footer(FILE* f, int check, int64_t wrong_total) {
  if (check)
    fprintf(f, "# Out of bounds values : %" PRId64 " %s\n", wrong_total,
            wrong_total ? "FAILED" : "OK");
  else
    fprintf(f, "# Out of bounds values : N/A (-c 0)\n");
}

void perf_print_summary_line(FILE* f, const char* label, double value) {
  fprintf(f, "# %-21s: %g \n", label, value);
}

/* ---- the JSON rows ----------------------------------------------------------------------- */

void perf_json_open(perf_json* j, FILE* f) {
  j->f = f;
  j->rows = 0;
  if (f != NULL) fprintf(f, "[\n");
}

void perf_json_row_start(perf_json* j) {
  if (j->f == NULL) return;
  fprintf(j->f, "%s  {", j->rows++ ? ",\n" : "");
}

void perf_json_row_head(perf_json* j, const char* impl, const char* collective, int nranks,
                        const perf_row* w) {
  if (j->f == NULL) return;
  fprintf(j->f,
          "\"impl\": \"%s\", \"collective\": \"%s\", \"mode\": \"%s\", \"nranks\": %d, "
          "\"size\": %" PRIu64 ", \"count\": %" PRIu64
          ", \"type\": \"%s\", \"redop\": \"%s\", \"root\": %d, \"density\": %.6g, \"k\": "
          "%" PRIu64 ", \"wire_bytes\": %.0f",
          impl, collective, w->mode, nranks, w->bytes, w->count, w->type, w->redop, w->root,
          w->density, w->k, w->wire);
}

void perf_json_row_tail(perf_json* j, const perf_row* w, int check) {
  static const char* kPlace[2] = {"out_of_place", "in_place"};
  if (j->f == NULL) return;
  for (int k = 0; k < 2; ++k) {
    const perf_place* p = &w->place[k];
    if (!p->ran) {
      fprintf(j->f, ", \"%s\": null", kPlace[k]);
      continue;
    }
    fprintf(j->f,
            ", \"%s\": {\"time_us\": %.3f, \"algbw_gbs\": %.4f, \"busbw_gbs\": %.4f, "
            "\"deq_bw_gbs\": %.4f, ",
            kPlace[k], p->time_us, p->algbw, p->busbw, p->deqbw);
    if (check)
      fprintf(j->f, "\"wrong\": %" PRId64 "}", p->wrong);
    else
      fprintf(j->f, "\"wrong\": null}");
  }
  fprintf(j->f, "}");
  fflush(j->f);
}

void perf_json_end(perf_json* j) {
  if (j->f != NULL) fprintf(j->f, "%s]\n", j->rows ? "\n" : "");
}

int perf_json_close(perf_json* j) {
  int rc = 0;
  if (j->f == NULL) return 0;
  perf_json_end(j);
  if (fclose(j->f) != 0) rc = -1;
  j->f = NULL;
  return rc;
}
