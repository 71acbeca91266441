#!/usr/bin/env python3
"""Fails when a layer includes one it must not (docs/ARCHITECTURE.md, "Who may include whom").

Reads every C/C++/CUDA source and header under the library's folders, takes each
`#include "..."` and `#include <...>`, and checks it against the table below. Run by ctest
(test name LayerIncludes) and by hand:

    python3 tests/check_layers.py [repo-root]

A line `// layer-exception: <reason>` on the include line itself lets one include through; each
one is listed in docs/ARCHITECTURE.md with why it is still there.
"""
import os
import re
import sys

# Folder (prefix of the including file's path) -> prefixes of repo-rooted quoted includes it may
# use. The most specific folder wins. "scape/" is the public header, always allowed.
ALLOWED = {
    "include/scape/": [],
    "base/": ["base/"],
    "kernels/": ["kernels/", "base/"],
    "transport/": ["transport/", "base/"],
    "plugin/coll/": ["plugin/coll/", "transport/transport.h", "kernels/", "base/"],
    "plugin/core/": ["plugin/core/", "plugin/coll/", "transport/transport.h",
                     "transport/bootstrap/", "transport/ucx/", "base/"],
    "plugin/mask/": ["plugin/mask/", "plugin/core/", "plugin/coll/", "kernels/", "base/"],
    "plugin/optim/": ["plugin/optim/", "plugin/mask/", "plugin/core/", "plugin/coll/",
                      "plugin/device/", "kernels/", "base/"],
    "plugin/device/": ["plugin/device/", "plugin/core/", "plugin/coll/", "plugin/mask/",
                       "kernels/", "base/"],
    "plugin/api/": ["plugin/", "transport/bootstrap/", "kernels/", "base/"],
    "plugin/nccl/": ["plugin/nccl/", "transport/bootstrap/socket.h", "transport/ucx/", "base/"],
}
# System headers only some folders may include: UCX only where the transport is implemented (the
# library's endpoint interface and the NCCL plugin's engine); CUDA and NCCL only in the kernels
# and the device layer.
RESTRICTED_SYSTEM = [
    (re.compile(r"^(ucp|uct|ucs)/"), ["transport/ucx/", "plugin/nccl/"]),
    (re.compile(r"^(cuda|cuda_runtime|cuda_runtime_api|cuda_fp16|cuda_bf16)\.h$|^cub/|^thrust/"),
     ["kernels/cuda/", "plugin/device/", "kernels/"]),
    (re.compile(r"^nccl(_net)?\.h$"), ["plugin/device/"]),
]
SOURCE_EXT = (".h", ".hpp", ".cc", ".cpp", ".c", ".cu", ".cuh")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"](.*)$')


def layer_of(path):
    best = None
    for folder in ALLOWED:
        if path.startswith(folder) and (best is None or len(folder) > len(best)):
            best = folder
    return best


def check(root):
    errors = []
    checked = 0
    for top in ("include", "base", "kernels", "transport", "plugin"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                if not name.endswith(SOURCE_EXT):
                    continue
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                layer = layer_of(rel)
                if layer is None:
                    errors.append(f"{rel}: in no layer of the table (add its folder to ALLOWED)")
                    continue
                checked += 1
                with open(full, encoding="utf-8", errors="replace") as f:
                    for lineno, line in enumerate(f, 1):
                        m = INCLUDE_RE.match(line)
                        if not m:
                            continue
                        kind, inc, rest = m.groups()
                        if "layer-exception:" in rest:
                            continue
                        where = f"{rel}:{lineno}"
                        if kind == '"':
                            if inc.startswith("scape/") or "/" not in inc:
                                continue  # public header, the generated scape_config.h, or a file beside this one
                            if not any(inc.startswith(p) for p in ALLOWED[layer]):
                                errors.append(f'{where}: layer {layer} must not include "{inc}"')
                        else:
                            for pattern, allowed in RESTRICTED_SYSTEM:
                                if pattern.search(inc) and not any(rel.startswith(a) for a in allowed):
                                    errors.append(f"{where}: layer {layer} must not include <{inc}>")
    return checked, errors


def self_test():
    """The check must be able to fail: a tree with one bad include of each kind is refused."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        def put(rel, text):
            os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
            with open(os.path.join(tmp, rel), "w") as f:
                f.write(text)
        put("kernels/cpu/k.cc", '#include "plugin/core/comm.h"\n')           # upward
        put("plugin/coll/c.cc", "#include <ucp/api/ucp.h>\n")                 # UCX in an algorithm
        put("plugin/coll/ok.cc", '#include "plugin/coll/coll.h"\n#include "x.h"\n')
        put("base/b.cc", '#include "plugin/core/comm.h"  // layer-exception: test\n')
        checked, errors = check(tmp)
        want = {"kernels/cpu/k.cc:1", "plugin/coll/c.cc:1"}
        got = {e.split(": ")[0] for e in errors}
        if checked != 4 or got != want:
            print("check_layers self-test failed:", checked, errors)
            return 1
    print("check_layers self-test: 2 planted violations found, exceptions honoured")
    return 0


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--self-test":
        return self_test()
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    checked, errors = check(os.path.abspath(root))
    for e in errors:
        print(e)
    if checked == 0:
        print("check_layers: no source files found under", root)
        return 1
    print(f"check_layers: {checked} files, {len(errors)} violations")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
