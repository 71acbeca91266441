// Every SCAPE_* environment variable is declared once, in the table in param.cc, with its
// default and a one-line description; README.md's configuration table mirrors it. Reading a
// name that is not in the table is a programming error (it aborts in debug builds).
#ifndef SCAPE_BASE_PARAM_H_
#define SCAPE_BASE_PARAM_H_

#include <cstdint>
#include <string>

namespace scape {

struct ParamInfo {
  const char* name;
  const char* defaultValue;  // "" means "unset / derived at run time"
  const char* doc;
};

// The table, terminated by an entry with name == nullptr.
const ParamInfo* ParamTable();

// The environment's value of a declared parameter, or its default when unset or empty.
std::string ParamString(const char* name);
// As ParamString, parsed as an integer; `fallback` when unset; `ok` false if malformed.
int64_t ParamInt(const char* name, int64_t fallback, bool* ok = nullptr);

}  // namespace scape

#endif  // SCAPE_BASE_PARAM_H_
