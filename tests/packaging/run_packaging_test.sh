#!/usr/bin/env bash
# Packaging test (ctest: Packaging.InstallAndConsume). Installs a built SCAPE tree into a
# temporary prefix, checks what was installed (versioned library names, SONAME, public headers
# only, no path into the source or build tree), then builds and runs a C consumer
# (consumer/consumer.c) outside the tree twice: through find_package(scape) and through
# pkg-config. Finally moves the prefix and builds through pkg-config again (scape.pc is
# relocatable).
#
#   bash tests/packaging/run_packaging_test.sh BUILD_DIR PACKAGING_DIR VERSION [perf|noperf]
#
# Needs a complete build of BUILD_DIR (cmake --install installs every target). KEEP=1 keeps
# the temporary directory.
set -u -o pipefail

build=$(cd "${1:?usage: run_packaging_test.sh BUILD_DIR PACKAGING_DIR VERSION}" && pwd)
here=$(cd "${2:?PACKAGING_DIR}" && pwd)
version=${3:?VERSION}
perf=${4:-perf}  # "noperf" when the build has no scape-perf (SCAPE_BUILD_PERF=OFF)
major=${version%%.*}
src=$(cd "$here/../.." && pwd)
cc=${CC:-cc}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/scape-packaging.XXXXXX")
cleanup() { if [ "${KEEP:-0}" = 1 ]; then echo "kept $tmp"; else rm -rf "$tmp"; fi; }
trap cleanup EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
pass() { echo "ok:   $*"; }
run_logged() {  # name, command...: runs it, shows the log only when it fails
  local name=$1; shift
  if "$@" >"$tmp/$name.log" 2>&1; then return 0; fi
  echo "---- $name failed: $*"; tail -40 "$tmp/$name.log"; return 1
}

prefix=$tmp/prefix
run_logged install cmake --install "$build" --prefix "$prefix" || { fail "cmake --install"; exit 1; }
pass "cmake --install into $prefix"

# ---- the library and its names ---------------------------------------------------------------
real=$(find "$prefix" -name "libnccl-net-scape.so.$version" -type f | head -1)
[ -n "$real" ] || { fail "no regular file libnccl-net-scape.so.$version under $prefix"; exit 1; }
libdir=$(dirname "$real")
pass "library: ${real#"$prefix"/}"
expect_link() {  # link target
  local got
  got=$(readlink "$libdir/$1" 2>/dev/null) || { fail "$1 is not a symlink"; return; }
  [ "$got" = "$2" ] && pass "$1 -> $2" || fail "$1 -> $got, expected -> $2"
}
expect_link "libnccl-net-scape.so.$major" "libnccl-net-scape.so.$version"
expect_link "libnccl-net-scape.so" "libnccl-net-scape.so.$major"
expect_link "libnccl-net.so" "libnccl-net-scape.so.$major"
soname=$(readelf -d "$real" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')
[ "$soname" = "libnccl-net-scape.so.$major" ] && pass "SONAME $soname" ||
  fail "SONAME '$soname', expected libnccl-net-scape.so.$major"

# ---- headers: the public ones, nothing internal ----------------------------------------------
headers=$(cd "$prefix/include" 2>/dev/null && find . -type f | sort | tr '\n' ' ')
[ "$headers" = "./scape/scape.h ./scape/scape_version.h " ] && pass "headers: $headers" ||
  fail "installed headers are '$headers', expected exactly scape/scape.h scape/scape_version.h"
grep -q "#define SCAPE_VERSION_STRING \"$version\"" "$prefix/include/scape/scape_version.h" &&
  pass "scape_version.h says $version" || fail "scape_version.h does not say $version"

# ---- package files: present, and pointing into the prefix only -------------------------------
for f in "$libdir/cmake/scape/scapeConfig.cmake" "$libdir/cmake/scape/scapeConfigVersion.cmake" \
         "$libdir/cmake/scape/scapeTargets.cmake" "$libdir/pkgconfig/scape.pc"; do
  [ -f "$f" ] && pass "${f#"$prefix"/}" || fail "missing ${f#"$prefix"/}"
done
if grep -rlF -e "$src" -e "$build" "$libdir/cmake/scape" "$libdir/pkgconfig" >"$tmp/leaks" 2>/dev/null; then
  fail "installed package files name the source or build tree: $(tr '\n' ' ' <"$tmp/leaks")"
else
  pass "package files name neither the source nor the build tree"
fi

# ---- scape-perf ------------------------------------------------------------------------------
if [ -x "$prefix/bin/scape-perf" ]; then
  resolved=$(ldd "$prefix/bin/scape-perf" | sed -n "s/.*libnccl-net-scape.so.$major => \([^ ]*\).*/\1/p")
  if [ -n "$resolved" ] && [ "$(readlink -f "$resolved")" = "$(readlink -f "$real")" ]; then
    pass "bin/scape-perf loads the installed library ($resolved)"
  else
    fail "bin/scape-perf does not resolve the installed library: $(ldd "$prefix/bin/scape-perf" | grep nccl-net)"
  fi
  run_logged scape-perf-help "$prefix/bin/scape-perf" --help && pass "scape-perf --help" ||
    fail "scape-perf --help"
elif [ "$perf" = perf ]; then
  fail "no bin/scape-perf"
else
  pass "no scape-perf in this build (SCAPE_BUILD_PERF=OFF)"
fi

# ---- consumer through find_package(scape) ----------------------------------------------------
cm=$tmp/cmake-consumer
if run_logged cmake-configure cmake -S "$here/consumer" -B "$cm" -DCMAKE_PREFIX_PATH="$prefix" \
     -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DSCAPE_WANT_VERSION="$version" &&
   run_logged cmake-build cmake --build "$cm" &&
   run_logged cmake-run "$cm/consumer" && grep -q "consumer ok $version" "$tmp/cmake-run.log"; then
  pass "find_package(scape $version) consumer built and ran: $(cat "$tmp/cmake-run.log")"
else
  fail "find_package(scape) consumer"
fi
# The include directories the imported target carries: the prefix's include/ only.
inc=$(grep -o 'INTERFACE_INCLUDE_DIRECTORIES "[^"]*"' "$libdir/cmake/scape/scapeTargets.cmake")
[ "$inc" = 'INTERFACE_INCLUDE_DIRECTORIES "${_IMPORT_PREFIX}/include"' ] &&
  pass "scape::scape's include path is <prefix>/include only" || fail "scape::scape exports $inc"
# The version file must refuse an incompatible request (so the check above means something).
if cmake -S "$here/consumer" -B "$tmp/cmake-wrong" -DCMAKE_PREFIX_PATH="$prefix" \
     -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DSCAPE_WANT_VERSION=$((major + 1)).0 \
     >"$tmp/cmake-wrong.log" 2>&1; then
  fail "find_package(scape $((major + 1)).0) succeeded against $version"
else
  pass "find_package(scape $((major + 1)).0) refused"
fi

# ---- consumer through pkg-config -------------------------------------------------------------
pc_build() {  # libdir, output
  local modver cflags libs
  modver=$(PKG_CONFIG_PATH="$1/pkgconfig" pkg-config --modversion scape) || return 1
  [ "$modver" = "$version" ] || { echo "pkg-config --modversion: $modver"; return 1; }
  cflags=$(PKG_CONFIG_PATH="$1/pkgconfig" pkg-config --cflags scape) || return 1
  libs=$(PKG_CONFIG_PATH="$1/pkgconfig" pkg-config --libs scape) || return 1
  echo "cflags: $cflags libs: $libs"
  # shellcheck disable=SC2086
  $cc -std=c99 -Wall -Wextra -Werror $cflags "$here/consumer/consumer.c" -o "$2" $libs \
    -Wl,-rpath,"$1" && "$2"
}
if run_logged pkgconfig pc_build "$libdir" "$tmp/pc-consumer" &&
   grep -q "consumer ok $version" "$tmp/pkgconfig.log"; then
  pass "pkg-config consumer built and ran ($(head -1 "$tmp/pkgconfig.log"))"
else
  fail "pkg-config consumer"
fi
moved=$tmp/moved-prefix
mv "$prefix" "$moved"
if run_logged pkgconfig-moved pc_build "${libdir/#$prefix/$moved}" "$tmp/pc-consumer-moved" &&
   grep -q "consumer ok $version" "$tmp/pkgconfig-moved.log"; then
  pass "pkg-config consumer after moving the prefix"
else
  fail "pkg-config consumer after moving the prefix (scape.pc not relocatable)"
fi

if [ "$failures" -ne 0 ]; then
  echo "packaging test: $failures failure(s)"
  exit 1
fi
echo "packaging test: all checks passed"
