#!/usr/bin/env python3
"""Fails when docs/ARCHITECTURE.md or CONTRIBUTING.md name a path or a function the code lacks.

The walk in docs/ARCHITECTURE.md (and the "Adding ..." lists of CONTRIBUTING.md) names files and
functions hop by hop; this keeps those names true as the code moves. The rules, kept simple so
that a miss is a real one:

  - a path: any word that starts with one of the repository's top folders (base/, kernels/,
    plugin/, transport/, include/, tests/, perf/, python/, docs/, examples/, cmake/) followed by
    more path characters, such as `plugin/backend/masked.cc` or `kernels/cpu/`, must exist (a
    file or a folder). Placeholders and patterns (`<name>`, `*`) are not paths.
  - a function in a file, written in backticks as `file.cc: Name` (the text may break the line
    after the colon), or as `Name` (`file.cc` ...): every identifier of Name (`DataPath::Route`
    has two) must appear as a word in that file. A file named by its last component only
    (`api_mask.cc`) must be the only source file of that name in the repository.
  - a member alone, in backticks as `Class::Method`: some source file under base/, kernels/,
    plugin/, transport/ or include/ must contain `Class::Method`, or declare `class Class` /
    `struct Class` (or `struct Outer::Class`) and contain the word Method.

Only the code's text is read (nothing is compiled), so "appears" includes a declaration or a
call: the check catches renamed, moved and deleted names, not a sentence that describes a call
in the wrong order. Run by ctest (DocsPaths, with DocsPaths.SelfTest proving the check can
fail) and by hand:

    python3 tests/check_docs_paths.py [repo-root]
    python3 tests/check_docs_paths.py --self-test
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_layers import cli, plant, verdict  # noqa: E402  (shared with the other checks)

DOCS = ["docs/ARCHITECTURE.md", "CONTRIBUTING.md"]
TOP = ("base", "kernels", "plugin", "transport", "include", "tests", "perf", "python", "docs",
       "examples", "cmake")
LIBRARY = ("base/", "kernels/", "plugin/", "transport/", "include/")
SOURCE_EXT = (".h", ".hpp", ".cc", ".cpp", ".c", ".cu", ".cuh", ".py", ".sh")
SKIP_DIRS = {".git", "node_modules", "__pycache__", "repeat-logs", "shared"}

PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./<>*-]*)" % "|".join(TOP))
FILE = r"[\w./-]+\.(?:h|hpp|cc|cpp|c|cu|cuh|py|sh)"
NAME = r"~?[A-Za-z_]\w*(?:::~?[A-Za-z_]\w*)*"
# `file.cc: Name` (one backtick span, maybe broken across a line).
FILE_COLON_NAME = re.compile(r"`(%s):\s+(%s)`" % (FILE, NAME))
# `Name` (`file.cc` ...
NAME_PAREN_FILE = re.compile(r"`(%s)`\s+\(`(%s)`" % (NAME, FILE))
# `Class::Method` alone.
MEMBER = re.compile(r"`((?:[A-Za-z_]\w*::)+~?[A-Za-z_]\w*)`")


def source_files(root):
    """Repository-relative paths of the source files (build trees and dot folders left out)."""
    out = []
    for dirpath, dirs, files in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("build")
                         and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(SOURCE_EXT):
                out.append(name if rel_dir == "." else rel_dir + "/" + name)
    return out


class Repo:
    def __init__(self, root):
        self.root = root
        self.files = source_files(root)
        self._text = {}

    def text(self, rel):
        if rel not in self._text:
            with open(os.path.join(self.root, rel), encoding="utf-8", errors="replace") as f:
                self._text[rel] = f.read()
        return self._text[rel]

    def resolve(self, name):
        """The one file `name` means (a repository path, or a unique last component), or an
        error string."""
        if "/" in name:
            return name if os.path.isfile(os.path.join(self.root, name)) else \
                f"no file {name}"
        hits = [f for f in self.files if f.rsplit("/", 1)[-1] == name]
        if len(hits) == 1:
            return hits[0]
        if not hits:
            return f"no file named {name}"
        return f"{name} is ambiguous ({', '.join(hits)}): name it by its path"


def has_word(text, word):
    return re.search(r"(?<!\w)%s(?!\w)" % re.escape(word), text) is not None


def idents(name):
    return [p.lstrip("~") for p in name.split("::") if p]


def check_doc(repo, doc):
    errors = []
    with open(os.path.join(repo.root, doc), encoding="utf-8") as f:
        text = f.read()

    def where(pos):
        return f"{doc}:{text.count(chr(10), 0, pos) + 1}"

    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".")
        if "<" in path or "*" in path:
            continue
        if not os.path.exists(os.path.join(repo.root, path.rstrip("/"))):
            errors.append(f"{where(m.start())}: names {path}, which does not exist")

    def in_file(pos, fname, name):
        rel = repo.resolve(fname)
        if not rel.endswith(fname.rsplit("/", 1)[-1]) or " " in rel:
            errors.append(f"{where(pos)}: `{fname}: {name}`: {rel}")
            return
        missing = [w for w in idents(name) if not has_word(repo.text(rel), w)]
        if missing:
            errors.append(f"{where(pos)}: names {name} in {rel}, which has no "
                          f"{', '.join(missing)}")

    for m in FILE_COLON_NAME.finditer(text):
        in_file(m.start(), m.group(1), m.group(2))
    for m in NAME_PAREN_FILE.finditer(text):
        in_file(m.start(), m.group(2), m.group(1))

    library = [f for f in repo.files if f.startswith(LIBRARY)]
    for m in MEMBER.finditer(text):
        name = m.group(1)
        parts = idents(name)
        cls, member = parts[-2], parts[-1]
        decl = re.compile(r"\b(?:class|struct)\s+(?:\w+::)*%s\b" % re.escape(cls))
        if any(name in repo.text(f) or (decl.search(repo.text(f)) and
                                        has_word(repo.text(f), member)) for f in library):
            continue
        errors.append(f"{where(m.start())}: names {name}, which no library source has")
    return errors


def check(root, docs=DOCS):
    repo = Repo(root)
    errors = []
    checked = 0
    for doc in docs:
        if not os.path.isfile(os.path.join(root, doc)):
            errors.append(f"{doc}: missing")
            continue
        checked += 1
        errors += check_doc(repo, doc)
    return checked, errors


def self_test():
    """The check must be able to fail: a scratch tree whose page names a missing path, a
    function its file lacks, an ambiguous short file name and an unknown member is refused on
    exactly those lines, and the true names on the other lines pass."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        plant(tmp, "plugin/backend/masked.cc", "Status MaskedAllReduce() {}\n")
        plant(tmp, "plugin/backend/backend.h", "class DataPath {\n  Status Route();\n};\n")
        plant(tmp, "kernels/cpu/gather.cc", "void GatherByIndex() {}\n")
        plant(tmp, "kernels/cuda/gather.cc", "void Other() {}\n")
        plant(tmp, "CONTRIBUTING.md", "Nothing named here.\n")
        plant(tmp, "docs/ARCHITECTURE.md", "\n".join([
            "1. `plugin/backend/masked.cc: MaskedAllReduce` and `plugin/backend/`",  # ok
            "2. `DataPath::Route` and `plugin/backend/backend.h: DataPath::Route`",  # ok
            "3. `masked.cc: MaskedAllReduce` then `GatherByIndex` (`kernels/cpu/gather.cc`)",
            "4. `plugin/backend/<name>_backend.cc` and `perf/RESULTS*.md`",  # placeholders
            "5. `plugin/backend/gone.cc`",  # missing path
            "6. `plugin/backend/masked.cc: MaskedAllGather`",  # missing function
            "7. `gather.cc: GatherByIndex`",  # ambiguous short name
            "8. `DataPath::RouteBuffers`",  # missing member
            "9. `kernels/cpu/gather.cc:",
            "   ScatterByIndex`",  # missing, across a line break
            "10. `Missing` (`kernels/cpu/gather.cc`: its pass)",  # missing, Name (file) form
            "",
        ]))
        checked, errors = check(tmp)
        want = {"docs/ARCHITECTURE.md:%d" % n for n in (5, 6, 7, 8, 9, 11)}
        return verdict("check_docs_paths", checked, 2, errors, want,
                       "planted stale names found, true names and placeholders passed")


def main():
    return cli("check_docs_paths", check, self_test, sys.argv,
               f" ({', '.join(DOCS)}) checked against the tree")


if __name__ == "__main__":
    sys.exit(main())
