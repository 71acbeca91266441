// scape_param_table: README.md's configuration table, generated from the knob table in
// base/param.cc (the one declaration of every SCAPE_* variable).
//
//   scape_param_table                 print the table as Markdown
//   scape_param_table --check FILE    exit 1 (and show both) if FILE's table differs from it
//   scape_param_table --update FILE   rewrite FILE's table from it
//
// The table sits in FILE between a line that starts with kBegin and one that starts with kEnd.
// ctest runs --check on README.md, so a knob added, removed or redocumented in param.cc without
// the README (or the other way round) fails the build's tests.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "base/param.h"

namespace {

const char kBegin[] = "<!-- BEGIN knob table";
const char kEnd[] = "<!-- END knob table";

bool ReadFile(const char* path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

// Finds the table between the markers: [*begin, *end) is the text after the BEGIN line up to
// the start of the END line.
bool FindSection(const std::string& text, size_t* begin, size_t* end, std::string* err) {
  size_t b = text.find(kBegin);
  if (b == std::string::npos || (b > 0 && text[b - 1] != '\n')) {
    *err = std::string("no line starting with \"") + kBegin + "\"";
    return false;
  }
  size_t bodyStart = text.find('\n', b);
  if (bodyStart == std::string::npos) {
    *err = "nothing after the BEGIN marker";
    return false;
  }
  ++bodyStart;
  size_t e = text.find(kEnd, bodyStart);
  if (e == std::string::npos || text[e - 1] != '\n') {
    *err = std::string("no line starting with \"") + kEnd + "\" after the BEGIN marker";
    return false;
  }
  if (text.find(kBegin, bodyStart) < e) {
    *err = "two BEGIN markers";
    return false;
  }
  *begin = bodyStart;
  *end = e;
  return true;
}

int Usage() {
  std::fprintf(stderr, "usage: scape_param_table [--check FILE | --update FILE]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string table = scape::ParamTableMarkdown();
  if (argc == 1) {
    std::fputs(table.c_str(), stdout);
    return 0;
  }
  if (argc != 3) return Usage();
  const bool check = std::strcmp(argv[1], "--check") == 0;
  const bool update = std::strcmp(argv[1], "--update") == 0;
  if (!check && !update) return Usage();
  const char* path = argv[2];
  std::string text, err;
  if (!ReadFile(path, &text)) {
    std::fprintf(stderr, "scape_param_table: cannot read %s\n", path);
    return 2;
  }
  size_t b = 0, e = 0;
  if (!FindSection(text, &b, &e, &err)) {
    std::fprintf(stderr, "scape_param_table: %s: %s\n", path, err.c_str());
    return 1;
  }
  const std::string current = text.substr(b, e - b);
  if (check) {
    if (current == table) {
      std::printf("%s: the knob table matches base/param.cc (%zu bytes)\n", path, table.size());
      return 0;
    }
    std::fprintf(stderr,
                 "%s: the knob table differs from base/param.cc.\n--- %s has:\n%s--- "
                 "base/param.cc declares:\n%s--- Fix: edit base/param.cc, then run "
                 "`scape_param_table --update %s`.\n",
                 path, path, current.c_str(), table.c_str(), path);
    return 1;
  }
  if (current == table) return 0;
  text.replace(b, e - b, table);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  if (!out) {
    std::fprintf(stderr, "scape_param_table: cannot write %s\n", path);
    return 2;
  }
  std::printf("%s: knob table updated\n", path);
  return 0;
}
