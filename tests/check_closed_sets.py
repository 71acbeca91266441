#!/usr/bin/env python3
"""Fails when code outside a closed set's one home names what only that home may name.

A closed set is a family of types that the rest of the code must reach through one interface,
so that adding a member touches its home (and tests) only. Each set is a few rules below: a
rule is a name, the home (path prefixes where the names are allowed) and a regular expression
that finds the names. Comments are not read (a comment may point at a class); string literals
are. Run by ctest (ClosedSets, with ClosedSets.SelfTest proving the check can fail) and by hand:

    python3 tests/check_closed_sets.py [repo-root]
    python3 tests/check_closed_sets.py --self-test

The sets today:
  - backends (docs/ARCHITECTURE.md, plugin/backend/backend.h): outside plugin/backend/, no
    backend kind (there is no Backend::Kind: code asks Backend's questions, Takes, Topology,
    SharedPool ...), no switch on one, no downcast of a Backend, no NCCL reached through the
    data path, and no concrete backend class (the tests may name the classes and cast to them,
    to check which one a call was routed to).

  - element (payload) types (kernels/dtypes.h, CONTRIBUTING.md "Adding a payload type"): no
    switch over the floating-point types outside the table (it visits them, VisitFloat);
    scape-perf (perf/) is a client of the public API with its own independent codecs and a
    static_assert on scapeNumTypes, and tests keep their own references.

A further set is more entries in RULES. A line that must break a rule for
now carries `closed-set-exception: <why>` in a comment on the line itself.
"""
import os
import re
import sys
from collections import namedtuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_layers import cli, plant, verdict  # noqa: E402  (shared with the other checks)

# set: the closed set the rule guards; name: what the rule forbids; home: path prefixes (repo
# relative, "/" separated) where the names are allowed; pattern: what to look for in code.
Rule = namedtuple("Rule", "set name home pattern")

BACKEND_HOME = ["plugin/backend/"]
BACKEND_CLASSES = r"\b(HostBackend|UcxStagedBackend|NcclBackend)\b"

RULES = [
    Rule("backends", "a backend kind (Backend::Kind is gone: ask Backend's questions instead)",
         BACKEND_HOME, re.compile(r"\bKind::k(Host|UcxStaged|Nccl)\b")),
    Rule("backends", "a switch on a backend kind",
         BACKEND_HOME, re.compile(r"\bswitch\s*\([^)]*(->|\.)\s*kind\s*\(\s*\)")),
    Rule("backends", "a concrete backend class (reach it through Backend and DataPath)",
         BACKEND_HOME + ["tests/"], re.compile(BACKEND_CLASSES)),
    Rule("backends", "a downcast of a backend (ask Backend: SharedPool, Topology ...)",
         BACKEND_HOME + ["tests/"],
         re.compile(r"\b(static|dynamic|reinterpret)_cast\s*<[^>]*Backend\b")),
    Rule("backends", "NCCL reached through the data path (ask DataPath::Topology)",
         BACKEND_HOME, re.compile(r"(->|\.)\s*nccl\s*\(\s*\)|\bNcclInfo\b")),
]

TYPES_HOME = ["kernels/dtypes.h", "perf/", "tests/"]
RULES += [
    Rule("element types", "a switch over the floating-point types (visit them: VisitFloat)",
         TYPES_HOME,
         re.compile(r"\bcase\s+scape(Float32|Float16|Bfloat16|Float8E4M3|Float8E5M2)\b")),
]

SOURCE_EXT = (".h", ".hpp", ".cc", ".cpp", ".c", ".cu", ".cuh")
SKIP_DIRS = {".git", "node_modules", "__pycache__", "repeat-logs", "shared"}
EXCEPTION = "closed-set-exception:"


def strip_comments(text):
    """The text with comments blanked (newlines kept, so line numbers hold) and a list of the
    comments of each line (for the exception marker). String and character literals stay."""
    out = []
    comments = {}
    i, n, line = 0, len(text), 1
    state = None  # None, "line", "block", '"', "'"
    start = 0
    while i < n:
        c = text[i]
        nxt = text[i + 1] if i + 1 < n else ""
        if state is None:
            if c == "/" and nxt == "/":
                state, start = "line", i
                i += 2
                continue
            if c == "/" and nxt == "*":
                state, start = "block", i
                i += 2
                continue
            if c in "\"'":
                state = c
            out.append(c)
        elif state == "line":
            if c == "\n":
                comments.setdefault(line, []).append(text[start:i])
                state = None
                out.append(c)
            else:
                out.append(" ")
        elif state == "block":
            if c == "*" and nxt == "/":
                comments.setdefault(line, []).append(text[start:i + 2])
                state = None
                out.append("  ")
                i += 2
                continue
            out.append("\n" if c == "\n" else " ")
        else:  # inside a literal
            if c == "\\" and nxt:
                out.append(c + nxt)
                if nxt == "\n":
                    line += 1
                i += 2
                continue
            if c == state or c == "\n":
                state = None
            out.append(c)
        if c == "\n":
            line += 1
        i += 1
    if state == "line":
        comments.setdefault(line, []).append(text[start:])
    return "".join(out), comments


def sources(root):
    for dirpath, dirs, files in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("build")
                         and not (rel_dir == "." and d.startswith(".")))
        for name in sorted(files):
            if name.endswith(SOURCE_EXT):
                full = os.path.join(dirpath, name)
                yield os.path.relpath(full, root).replace(os.sep, "/"), full


def check(root, rules=RULES):
    errors = []
    checked = 0
    for rel, full in sources(root):
        checked += 1
        applicable = [r for r in rules if not any(rel.startswith(h) for h in r.home)]
        if not applicable:
            continue
        with open(full, encoding="utf-8", errors="replace") as f:
            code, comments = strip_comments(f.read())
        for lineno, text in enumerate(code.split("\n"), 1):
            for rule in applicable:
                m = rule.pattern.search(text)
                if not m:
                    continue
                if any(EXCEPTION in c for c in comments.get(lineno, [])):
                    continue
                errors.append(f"{rel}:{lineno}: {rule.set}: {rule.name}: '{m.group(0)}' "
                              f"outside {', '.join(rule.home)}")
    return checked, errors


def self_test():
    """The check must be able to fail: a tree with one violation of each rule is refused, and
    what is allowed (the home, the tests for classes, comments, other kinds) passes."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        def put(rel, text):
            plant(tmp, rel, text)
        # Violations, one a file (line 2 each).
        put("plugin/optim/kind.cc", "int f(B* b) {\n  return b->kind() == backend::Kind::kHost;\n}\n")
        put("plugin/api/switch.cc", "void f(B& b) {\n  switch (b.kind()) {}\n}\n")
        put("plugin/coll/cls.cc", "#include <x>\nstd::unique_ptr<NcclBackend> h;\n")
        put("tests/kind_test.cc", "// a test\nEXPECT_EQ(b->kind(), Kind::kUcxStaged);\n")
        put("perf/p.cc", "\nHostBackend h(comm); /* a comment after it */\n")
        put("plugin/api/str.cc", '\nconst char* s = "// not a comment"; UcxStagedBackend* u;\n')
        put("plugin/optim/cast.cc", "\np = static_cast<backend::DeviceBackend*>(b)->SharedPool();\n")
        put("plugin/api/nccl.cc", "\nif (comm->data->NcclInfo(&n, &r) || comm->data->nccl()) {}\n")
        put("plugin/coll/types.cc", "switch (t) {\n  case scapeBfloat16: return 2;\n}\n")
        # Allowed.
        put("plugin/backend/home.cc",
            "switch (b.kind()) {}\nKind::kNccl; HostBackend h; NcclBackend* n;\n")
        put("tests/route_test.cc", "bool ok = Is<UcxStagedBackend>(b) || Is<HostBackend>(b);\n"
            "auto* n = dynamic_cast<backend::NcclBackend*>(b);\n")
        put("plugin/api/ok.cc",
            "// routed to HostBackend, see Kind::kHost in history\n"
            "/* NcclBackend, UcxStagedBackend\n   switch (b.kind()) */\n"
            "const char* s = \"x\"; // HostBackend\n"
            "if (rt->Kind(p) == device::PtrKind::kHost) {}\n"
            "switch (rt->Kind(p)) {}\n"
            "DeviceBackend* d = data->device();\n"
            "NcclBackend* n;  // closed-set-exception: self-test\n")
        put("kernels/dtypes.h", "switch (t) {\n  case scapeFloat8E4M3: f(E4m3T{});\n}\n")
        put("perf/codec.h", "switch (t) {\n  case scapeFloat16: f(CodecF16{});\n}\n")
        put("build/gen.cc", "HostBackend h;\n")  # build trees are not read
        checked, errors = check(tmp)
        want = {"plugin/optim/kind.cc:2", "plugin/api/switch.cc:2", "plugin/coll/cls.cc:2",
                "tests/kind_test.cc:2", "perf/p.cc:2", "plugin/api/str.cc:2",
                "plugin/optim/cast.cc:2", "plugin/api/nccl.cc:2", "plugin/coll/types.cc:2"}
        return verdict("check_closed_sets", checked, 14, errors, want,
                       "planted violations found, homes, comments and exceptions honoured")


def main():
    sets = ", ".join(sorted({r.set for r in RULES}))
    return cli("check_closed_sets", check, self_test, sys.argv,
               f", {len(RULES)} rules ({sets})")


if __name__ == "__main__":
    sys.exit(main())
