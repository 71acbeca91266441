#!/usr/bin/env bash
# Checks that every tracked C/C++/CUDA file (*.c *.cc *.cpp *.h *.hpp *.cu *.cuh) is formatted as
# .clang-format says, with clang-format --dry-run --Werror. tests/run_all.sh runs it first.
#
#   SCAPE_CHECK_FORMAT=1 bash tests/check_format.sh         # check; exit 1 naming each file
#   bash tests/check_format.sh --fix                        # reformat those files in place
#
# On by default; SCAPE_CHECK_FORMAT=0 skips it (for a quick local run of the suite).
#
# CLANG_FORMAT names the binary (default: clang-format). The style was measured with
# clang-format 14 (Debian 12); other major versions may format a few constructs differently.
set -euo pipefail
cd "$(dirname "$0")/.."

enabled=${SCAPE_CHECK_FORMAT:-1}
fix=0
[ "${1:-}" = "--fix" ] && fix=1
if [ "$enabled" != 1 ] && [ "$fix" != 1 ]; then
  echo "check_format: skipped (SCAPE_CHECK_FORMAT=0)"
  exit 0
fi

cf=${CLANG_FORMAT:-clang-format}
if ! command -v "$cf" >/dev/null 2>&1; then
  echo "check_format: $cf not found (apt-get install clang-format, or set CLANG_FORMAT)" >&2
  exit 1
fi
[ -f .clang-format ] || { echo "check_format: no .clang-format at the repository root" >&2; exit 1; }

mapfile -t files < <(git ls-files -- '*.c' '*.cc' '*.cpp' '*.h' '*.hpp' '*.cu' '*.cuh')
checked=0
bad=()
for f in "${files[@]}"; do
  [ -f "$f" ] || continue  # deleted in the work tree but still in the index
  checked=$((checked + 1))
  if [ "$fix" = 1 ]; then
    "$cf" -i --style=file "$f"
  elif ! "$cf" --dry-run --Werror --style=file "$f" >/dev/null 2>&1; then
    bad+=("$f")
  fi
done

if [ "$fix" = 1 ]; then
  echo "check_format: reformatted $checked files with $("$cf" --version)"
  exit 0
fi
if [ ${#bad[@]} -gt 0 ]; then
  echo "check_format: ${#bad[@]} of $checked files are not formatted as .clang-format says:" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "first differences in ${bad[0]}:" >&2
  "$cf" --style=file "${bad[0]}" | diff -u "${bad[0]}" - | head -30 >&2 || true
  echo "fix with: bash tests/check_format.sh --fix   (or $cf -i FILE)" >&2
  exit 1
fi
echo "check_format: $checked files formatted as .clang-format says ($("$cf" --version))"
