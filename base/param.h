// The knob table: every SCAPE_* environment variable is declared once, in the table in
// param.cc, with its type, default, accepted values and the one-line description that
// README.md's configuration table is generated from (tests check that the two agree:
// `scape_param_table --check README.md`). Every read of a knob goes through this header; the
// library calls getenv nowhere else (ParamExternal covers the variables other software owns).
//
// Empty and unset are the same: an empty variable takes the default. A malformed value (not
// an integer, out of range, not one of the choices) is a configuration error: the typed
// getters return scapeInvalidUsage with a message that names the variable, its value and
// what is accepted. Reading a name that is not declared is a programming error (it aborts in
// debug builds, and reads as unset otherwise).
//
// SCAPE_DEBUG=INFO makes LogEffectiveParams (called once per process when a communicator or
// the NCCL plugin initialises) log every knob with its effective value and where it came from.
#ifndef SCAPE_BASE_PARAM_H_
#define SCAPE_BASE_PARAM_H_

#include <cstdint>
#include <string>

#include "base/status.h"

// Defaults that code needs as constants as well (struct member initialisers). The table in
// param.cc is built from these, so each is still written exactly once.
#define SCAPE_PARAM_DEFAULT_TIMEOUT_MS 120000

namespace scape {

inline constexpr int kDefaultTimeoutMs = SCAPE_PARAM_DEFAULT_TIMEOUT_MS;

enum class ParamType : int {
  kString = 0,  // any text
  kInt = 1,     // a decimal (or 0x hex) integer in [minValue, maxValue]
  kChoice = 2,  // one of `choices` (comma-separated, compared case-insensitively)
};

struct ParamInfo {
  const char* name;
  const char* defaultValue;  // the value an unset variable takes; "" = unset / derived at run time
  const char* doc;           // one line of Markdown: the README table's "meaning" column
  ParamType type = ParamType::kString;
  int64_t minValue = 0;              // kInt only
  int64_t maxValue = 0;              // kInt only
  const char* choices = nullptr;     // kChoice only, e.g. "auto,ring,rd"
  const char* defaultDoc = nullptr;  // README's "default" column when it is not defaultValue
};

// The table, terminated by an entry with name == nullptr.
const ParamInfo* ParamTable();
// The declaration of `name`, or nullptr.
const ParamInfo* FindParam(const char* name);

// The environment's value of a declared knob, or its default when unset or empty.
std::string ParamString(const char* name);
// As ParamString, as a pointer that stays valid while the environment is not changed: the
// variable's value, else its default; nullptr when both are empty.
const char* ParamCString(const char* name);
// True when the variable is set to a non-empty value (its value is not the default's).
bool ParamIsSet(const char* name);

// A kInt knob, parsed and range-checked (scapeInvalidUsage naming the variable otherwise).
Status ParamGetInt(const char* name, int64_t* out);
// A kInt knob's declared default (for callers that fall back to it after an error).
int64_t ParamDefaultInt(const char* name);
// A kChoice knob: the index of its value in the declared `choices` (scapeInvalidUsage if it is
// none of them).
Status ParamGetChoice(const char* name, int* out);

// A variable that other software owns and SCAPE only reads (UCX_NET_DEVICES, the launchers'
// RANK, WORLD_SIZE, SLURM_*, ...): its value, or nullptr when unset or empty. Not for SCAPE_*
// names, which must be declared in the table (asserts in debug builds).
const char* ParamExternal(const char* name);

// At INFO level, logs every knob once per process: "SCAPE_X=value (env|default)". `who` names
// the caller (e.g. "communicator", "NCCL net plugin").
void LogEffectiveParams(const char* who);

// README.md's configuration table (header row included), one knob per line, as Markdown.
std::string ParamTableMarkdown();

}  // namespace scape

#endif  // SCAPE_BASE_PARAM_H_
