"""The training text: the English fortune databases of Debian's `fortunes` package (the
default, and the CI smoke's), or (issue 42 item 1) the reStructuredText sources of the Python
3.11 documentation in Debian's `python3.11-doc` (`pydoc`: 497 documents, 11 MB, a corpus a
run of up to about 0.5M parameters at 20 tokens per parameter reads less than once).

Which one: `load(corpus=...)`, else the environment's SCAPE_TRAIN_CORPUS, else fortunes.
Documents are the fortunes (separated by a line holding only "%" in each database file), or
the documentation's source files (one .rst.txt a document).
`python3 perf/train/data.py [--corpus pydoc]` prints the corpus, its split and its unigram /
bigram cross-entropies; OnePass batches read each training token at most once.
Tokens are bytes (0..255) plus a document separator (256) before every document. Train and
validation are split by document, deterministically (a hash of the document's index, so the
split does not depend on file order or rank count), and each rank trains on its own shard of
the training documents.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

PACKAGE = "fortunes"
FORTUNE_DIR = "/usr/share/games/fortunes"
PYDOC_PACKAGE = "python3.11-doc"
PYDOC_DIR = "/usr/share/doc/python3.11/html/_sources"
CORPORA = ("fortunes", "pydoc")
SEP = 256  # document separator token
VOCAB = 257


@dataclass
class Corpus:
    package: str
    version: str
    files: List[str]
    sha256: str           # of the concatenated text files, in sorted path order
    n_documents: int
    train_docs: List[bytes]
    val_docs: List[bytes]

    def describe(self) -> Dict[str, object]:
        return {"package": self.package, "version": self.version, "sha256": self.sha256,
                "files": len(self.files), "documents": self.n_documents,
                "train_documents": len(self.train_docs), "val_documents": len(self.val_docs),
                "train_bytes": sum(len(d) for d in self.train_docs),
                "val_bytes": sum(len(d) for d in self.val_docs)}


def package_version(pkg: str = PACKAGE) -> str:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_files(pkg: str = PACKAGE, root: str = FORTUNE_DIR) -> List[str]:
    """The package's fortune text files (not the .dat indexes, not the .u8 symlinks)."""
    files = []
    try:
        out = subprocess.run(["dpkg-query", "-L", pkg], capture_output=True, text=True,
                             timeout=30)
        listed = out.stdout.split() if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        listed = []
    if not listed and os.path.isdir(root):
        listed = [os.path.join(root, f) for f in os.listdir(root)]
    for f in listed:
        if (f.startswith(root + "/") and os.path.isfile(f) and not os.path.islink(f)
                and "." not in os.path.basename(f) and os.path.exists(f + ".dat")):
            files.append(f)
    return sorted(files)


def split_documents(text: bytes) -> List[bytes]:
    docs = []
    for chunk in text.split(b"\n%\n"):
        chunk = chunk.strip(b"\n%")
        if chunk.strip():
            docs.append(chunk + b"\n")
    return docs


def is_validation(doc_index: int, val_fraction: float) -> bool:
    h = hashlib.sha256(doc_index.to_bytes(8, "little")).digest()
    return int.from_bytes(h[:8], "little") / 2.0 ** 64 < val_fraction


def pydoc_files(pkg: str = PYDOC_PACKAGE, root: str = PYDOC_DIR) -> List[str]:
    """The documentation's reStructuredText sources (every .rst.txt under root), sorted."""
    files = []
    for d, _, names in os.walk(root):
        files.extend(os.path.join(d, f) for f in names if f.endswith(".rst.txt"))
    return sorted(files)


def load(val_fraction: float = 0.1, corpus: Optional[str] = None) -> Corpus:
    name = corpus or os.environ.get("SCAPE_TRAIN_CORPUS") or "fortunes"
    if name not in CORPORA:
        raise ValueError(f"corpus {name!r}: expected one of {', '.join(CORPORA)}")
    pkg = PACKAGE if name == "fortunes" else PYDOC_PACKAGE
    files = package_files() if name == "fortunes" else pydoc_files()
    if not files:
        where = FORTUNE_DIR if name == "fortunes" else PYDOC_DIR
        raise FileNotFoundError(f"no {name} text under {where}: install Debian's '{pkg}' "
                                f"package (perf/train/setup_env.sh does)")
    h = hashlib.sha256()
    docs: List[bytes] = []
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        h.update(data)
        if name == "fortunes":
            docs.extend(split_documents(data))
        elif data.strip():
            docs.append(data)
    train, val = [], []
    for i, d in enumerate(docs):
        (val if is_validation(i, val_fraction) else train).append(d)
    return Corpus(pkg, package_version(pkg), files, h.hexdigest(), len(docs), train, val)


def encode(docs: List[bytes]) -> np.ndarray:
    """Concatenated token stream: SEP, bytes of doc 0, SEP, bytes of doc 1, ..."""
    parts = []
    for d in docs:
        parts.append(np.array([SEP], dtype=np.int64))
        parts.append(np.frombuffer(d, dtype=np.uint8).astype(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def decode(tokens: np.ndarray) -> bytes:
    return bytes(int(t) for t in tokens if t != SEP)


def rank_shard(docs: List[bytes], rank: int, size: int) -> List[bytes]:
    """Rank `rank`'s training documents: every size-th document, from the rank-th on."""
    return docs[rank::size]


class Batches:
    """Random windows of `context + 1` tokens from one rank's stream, from a seeded generator
    (the same seed and rank give the same batches)."""

    def __init__(self, stream: np.ndarray, context: int, batch: int, seed: int) -> None:
        if len(stream) < context + 2:
            raise ValueError(f"shard of {len(stream)} tokens is shorter than a window")
        self.stream, self.context, self.batch = stream, context, batch
        self.rng = np.random.default_rng(seed)

    def next(self) -> Tuple[np.ndarray, np.ndarray]:
        starts = self.rng.integers(0, len(self.stream) - self.context - 1, self.batch)
        win = np.stack([self.stream[s:s + self.context + 1] for s in starts])
        return win[:, :-1], win[:, 1:]


class OnePass:
    """Windows of `context + 1` tokens from one rank's stream, each training token read at most
    once: the stream is cut into consecutive windows (the last token of one is the first of the
    next, as a prediction target needs), taken in a seeded random order without replacement.
    Asking for more than the stream holds raises (the run would read data twice): size a run
    with `windows_left` / `capacity`."""

    def __init__(self, stream: np.ndarray, context: int, batch: int, seed: int) -> None:
        n = (len(stream) - 1) // context
        if n < batch:
            raise ValueError(f"shard of {len(stream)} tokens holds {n} windows, fewer than a "
                             f"batch of {batch}")
        self.stream, self.context, self.batch = stream, context, batch
        self.order = np.random.default_rng(seed).permutation(n)
        self.pos = 0

    @property
    def capacity(self) -> int:
        """Batches the stream holds."""
        return len(self.order) // self.batch

    def windows_left(self) -> int:
        return len(self.order) - self.pos

    def next(self) -> Tuple[np.ndarray, np.ndarray]:
        if self.pos + self.batch > len(self.order):
            raise RuntimeError(f"OnePass: batch {self.pos // self.batch + 1} would read data a "
                               f"second time (the shard holds {self.capacity} batches of "
                               f"{self.batch} windows of {self.context} tokens)")
        idx = self.order[self.pos:self.pos + self.batch]
        self.pos += self.batch
        c = self.context
        win = np.stack([self.stream[i * c:i * c + c + 1] for i in idx])
        return win[:, :-1], win[:, 1:]


def ngram_baselines(c: Corpus) -> Dict[str, float]:
    """Cross-entropy (nats per token) on the validation documents of the unigram and bigram
    models fit on the training documents (add-one smoothing over the vocabulary), over the
    tokens a model predicts (every token after the first of the stream)."""
    tr, va = encode(c.train_docs), encode(c.val_docs)
    uni = np.bincount(tr, minlength=VOCAB).astype(np.float64) + 1.0
    uni /= uni.sum()
    big = np.ones((VOCAB, VOCAB), dtype=np.float64)
    np.add.at(big, (tr[:-1], tr[1:]), 1.0)
    big /= big.sum(axis=1, keepdims=True)
    x, y = va[:-1], va[1:]
    return {"unigram": float(-np.log(uni[y]).mean()),
            "bigram": float(-np.log(big[x, y]).mean())}


def eval_windows(stream: np.ndarray, context: int, limit: Optional[int] = None) -> np.ndarray:
    """Non-overlapping windows of `context + 1` tokens covering the stream (the validation
    set), at most `limit` of them, evenly spaced."""
    n = (len(stream) - 1) // context
    idx = np.arange(n)
    if limit is not None and n > limit:
        idx = np.linspace(0, n - 1, limit).astype(np.int64)
    return np.stack([stream[i * context:i * context + context + 1] for i in idx])


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="the training corpus, its split and baselines")
    ap.add_argument("--corpus", choices=CORPORA, default=None)
    a = ap.parse_args()
    c = load(corpus=a.corpus)
    print(json.dumps(c.describe()))
    b = ngram_baselines(c)
    print(f"Corpus baselines (validation, nats per token): unigram {b['unigram']:.3f}, "
          f"bigram {b['bigram']:.3f}")
