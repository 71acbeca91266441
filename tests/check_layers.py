#!/usr/bin/env python3
"""Fails when a layer includes one it must not (docs/ARCHITECTURE.md, "Who may include whom").

Reads every C/C++/CUDA source and header under the library's folders, takes each
`#include "..."` and `#include <...>`, and checks it against the table below. Run by ctest
(test name LayerIncludes) and by hand:

    python3 tests/check_layers.py [repo-root]

A line `// layer-exception: <reason>` on the include line itself lets one include through; each
one is listed in docs/ARCHITECTURE.md with why it is still there.

UCX stays inside the UCX layer (transport/ucx/): UCX's own headers (<ucp/...>, <ucs/...>,
<uct/...>) are refused anywhere else, and so is any repository header that includes one,
directly or through other repository headers (found by reading the tree, so a new header that
pulls UCX in is covered without editing this file). The NCCL plugin reaches UCX through
transport/ucx/ucx_layer.h, which names no UCX type.
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
                     "transport/bootstrap/", "base/"],
    "plugin/mask/": ["plugin/mask/", "plugin/core/", "plugin/coll/", "kernels/", "base/"],
    "plugin/optim/": ["plugin/optim/", "plugin/backend/", "plugin/mask/", "plugin/core/",
                      "plugin/coll/", "plugin/device/", "kernels/", "base/"],
    "plugin/device/": ["plugin/device/", "plugin/core/", "plugin/coll/", "plugin/mask/",
                       "kernels/", "base/"],
    "plugin/backend/": ["plugin/backend/", "plugin/device/", "plugin/core/", "plugin/coll/",
                        "plugin/mask/", "kernels/", "base/"],
    "plugin/api/": ["plugin/", "transport/bootstrap/", "kernels/", "base/"],
    "plugin/nccl/": ["plugin/nccl/", "transport/bootstrap/socket.h", "transport/bootstrap/host.h",
                     "transport/ucx/ucx_layer.h", "base/"],
}
# System headers only some folders may include: UCX only in the UCX layer (transport/ucx/: the
# library's transport and the layer the NCCL plugin's engine goes through); CUDA and NCCL only
# in the kernels and the device layer.
UCX_SYSTEM = re.compile(r"^(ucp|uct|ucs)/")
UCX_LAYER = "transport/ucx/"
RESTRICTED_SYSTEM = [
    (UCX_SYSTEM, [UCX_LAYER]),
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


def includes_of(root):
    """{repo-relative path: [(lineno, kind, include, rest of line)]} for every library source."""
    out = {}
    for top in ("include", "base", "kernels", "transport", "plugin"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                if not name.endswith(SOURCE_EXT):
                    continue
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                incs = []
                with open(full, encoding="utf-8", errors="replace") as f:
                    for lineno, line in enumerate(f, 1):
                        m = INCLUDE_RE.match(line)
                        if m:
                            incs.append((lineno,) + m.groups())
                out[rel] = incs
    return out


def ucx_bearing(incs):
    """Repository files that include a UCX header, directly or through repository headers."""
    bearing = {rel for rel, lst in incs.items()
               if any(kind == "<" and UCX_SYSTEM.search(inc) for _, kind, inc, _ in lst)}
    grew = True
    while grew:
        grew = False
        for rel, lst in incs.items():
            if rel not in bearing and any(kind == '"' and inc in bearing for _, kind, inc, _ in lst):
                bearing.add(rel)
                grew = True
    return bearing


def check(root):
    errors = []
    incs = includes_of(root)
    bearing = ucx_bearing(incs)
    checked = 0
    for rel in sorted(incs):
        layer = layer_of(rel)
        if layer is None:
            errors.append(f"{rel}: in no layer of the table (add its folder to ALLOWED)")
            continue
        checked += 1
        for lineno, kind, inc, rest in incs[rel]:
            if "layer-exception:" in rest:
                continue
            where = f"{rel}:{lineno}"
            if kind == '"':
                if inc.startswith("scape/") or "/" not in inc:
                    continue  # public header, the generated scape_config.h, or a file beside this one
                if not any(inc.startswith(p) for p in ALLOWED[layer]):
                    errors.append(f'{where}: layer {layer} must not include "{inc}"')
                elif inc in bearing and not rel.startswith(UCX_LAYER):
                    errors.append(f'{where}: "{inc}" brings UCX headers outside the UCX layer '
                                  f"({UCX_LAYER})")
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
            plant(tmp, rel, text)
        put("kernels/cpu/k.cc", '#include "plugin/core/comm.h"\n')           # upward
        put("plugin/coll/c.cc", "#include <ucp/api/ucp.h>\n")                 # UCX in an algorithm
        put("plugin/core/u.cc", "#include <ucs/type/status.h>\n")             # UCX above the layer
        put("plugin/nccl/u.cc", "#include <ucp/api/ucp.h>\n")                 # ... in the plugin
        # The plugin's one door into the layer, planted with a UCX include: refused where used,
        # not where it is (a header that pulls UCX in is as bad as UCX's own).
        put("transport/ucx/ucx_layer.h", "#include <ucp/api/ucp.h>\n")
        put("transport/ucx/ucx_layer.cc", '#include "transport/ucx/ucx_layer.h"\n')
        put("plugin/nccl/n.cc", '#include "transport/ucx/ucx_layer.h"\n')
        put("plugin/core/s.cc", '#include "transport/ucx/ucx_status.h"\n')  # not the core's
        put("plugin/coll/ok.cc", '#include "plugin/coll/coll.h"\n#include "x.h"\n')
        put("base/b.cc", '#include "plugin/core/comm.h"  // layer-exception: test\n')
        checked, errors = check(tmp)
        want = {"kernels/cpu/k.cc:1", "plugin/coll/c.cc:1", "plugin/core/u.cc:1",
                "plugin/nccl/u.cc:1", "plugin/nccl/n.cc:1", "plugin/core/s.cc:1"}
        got = {e.split(": ")[0] for e in errors}
        if checked != 10 or got != want:
            print("check_layers self-test failed:", checked, errors)
            return 1
    print(f"check_layers self-test: {len(want)} planted violations found, exceptions honoured")
    return 0


def cli(name, check_fn, self_test_fn, argv, what=""):
    """The command line both checks share (check_closed_sets.py too): [repo-root] or
    --self-test; prints each violation and a count, exit status 1 on any (or on no files)."""
    if len(argv) > 1 and argv[1] == "--self-test":
        return self_test_fn()
    root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    checked, errors = check_fn(os.path.abspath(root))
    for e in errors:
        print(e)
    if checked == 0:
        print(f"{name}: no source files found under", root)
        return 1
    print(f"{name}: {checked} files{what}, {len(errors)} violations")
    return 1 if errors else 0


def verdict(name, checked, want_checked, errors, want, passed):
    """The end of check_closed_sets' and check_docs_paths' self-tests: 0 when the scratch tree's
    check read want_checked files and reported exactly the places in `want` ("path:line"), once
    each; else 1, with what it found."""
    got = {":".join(e.split(":")[:2]) for e in errors}
    if checked != want_checked or got != want or len(errors) != len(want):
        print(f"{name} self-test failed:", checked, errors)
        return 1
    print(f"{name} self-test: {len(want)} {passed}")
    return 0


def plant(tmp, rel, text):
    """Writes a planted file of a self-test's scratch tree."""
    os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
    with open(os.path.join(tmp, rel), "w") as f:
        f.write(text)


def main():
    return cli("check_layers", check, self_test, sys.argv)


if __name__ == "__main__":
    sys.exit(main())
