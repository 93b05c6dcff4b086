"""Multi-domain text found on any Debian + CPython machine, split deterministically.

Domains (index = label in traces):
  0 python  -- CPython's standard library sources
  1 c       -- C headers under /usr/include
  2 prose   -- English prose from /usr/share/doc (READMEs, copyright texts; duplicates removed)
  3 math    -- arithmetic word problems generated from a seeded RNG

A file goes to the held-out split when crc32(relative path) % 10 == 0, so the split does not
depend on file order or on which other files exist.
"""

from __future__ import annotations

import gzip
import os
import random
import sysconfig
import zlib
from dataclasses import dataclass
from typing import Iterator

DOMAINS = ("python", "c", "prose", "math")


@dataclass(frozen=True)
class Split:
    train: dict[str, str]  # domain -> text
    heldout: dict[str, str]


def _is_heldout(relpath: str) -> bool:
    return zlib.crc32(relpath.encode()) % 10 == 0


def _walk(root: str, accept) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in sorted(filenames):
            p = os.path.join(dirpath, fn)
            if accept(p) and os.path.isfile(p) and not os.path.islink(p):
                yield p


def _read(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read(200_000)
        return data.decode("utf-8")
    except (UnicodeDecodeError, OSError, EOFError):
        return ""


def _python_files() -> Iterator[tuple[str, str]]:
    root = sysconfig.get_paths()["stdlib"]
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo")

    def ok(p: str) -> bool:
        parts = os.path.relpath(p, root).split(os.sep)
        return p.endswith(".py") and not any(s in parts for s in skip)

    for p in _walk(root, ok):
        yield os.path.relpath(p, root), _read(p)


def _c_files() -> Iterator[tuple[str, str]]:
    root = "/usr/include"
    for p in _walk(root, lambda p: p.endswith(".h")):
        yield os.path.relpath(p, root), _read(p)


def _prose_files() -> Iterator[tuple[str, str]]:
    root = "/usr/share/doc"

    def ok(p: str) -> bool:
        b = os.path.basename(p)
        return b == "copyright" or b.startswith("README") or b.endswith((".txt", ".md", ".txt.gz", ".md.gz"))

    seen: set[int] = set()
    for p in _walk(root, ok):
        paras = []
        for para in _read(p).split("\n\n"):
            # licence texts repeat across packages: keep each paragraph once
            h = zlib.crc32(" ".join(para.split()).encode())
            if h in seen or len(para) < 40:
                continue
            seen.add(h)
            paras.append(para.strip())
        if paras:
            yield os.path.relpath(p, root), "\n\n".join(paras)


_NAMES = ("Ada", "Ben", "Chloe", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena")
_ITEMS = ("apples", "books", "coins", "pencils", "marbles", "cards", "stamps", "shells", "boxes", "tickets")


def _math_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    n1, n2 = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        return f"{n1} has {a} {item}. {n2} gives {n1} {b} more. How many {item} does {n1} have? {a} + {b} = {a + b}."
    if kind == 1:
        hi, lo = max(a, b), min(a, b)
        return f"{n1} had {hi} {item} and lost {lo}. How many are left? {hi} - {lo} = {hi - lo}."
    if kind == 2:
        return f"There are {c} bags with {a} {item} each. How many {item} in total? {c} * {a} = {c * a}."
    return f"{n1} shares {c * a} {item} equally among {c} friends. Each gets {c * a} / {c} = {a}."


def _math_text(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    out, n = [], 0
    while n < chars:
        s = _math_problem(rng)
        out.append(s)
        n += len(s) + 1
    return "\n".join(out)


def load_corpus(chars_per_domain: int = 2_000_000, heldout_chars: int = 200_000) -> Split:
    """Text per domain, capped at ``chars_per_domain`` (train) and ``heldout_chars`` (held-out)."""
    sources = {"python": _python_files, "c": _c_files, "prose": _prose_files}
    train: dict[str, str] = {}
    held: dict[str, str] = {}
    for dom, gen in sources.items():
        tr, he, ntr, nhe = [], [], 0, 0
        for rel, text in gen():
            if not text:
                continue
            if _is_heldout(rel):
                if nhe < heldout_chars:
                    he.append(text)
                    nhe += len(text)
            elif ntr < chars_per_domain:
                tr.append(text)
                ntr += len(text)
            if ntr >= chars_per_domain and nhe >= heldout_chars:
                break
        if ntr == 0 or nhe == 0:
            raise RuntimeError(f"testbed corpus: found no {dom} text on this machine")
        train[dom] = "\n".join(tr)[:chars_per_domain]
        held[dom] = "\n".join(he)[:heldout_chars]
    train["math"] = _math_text(seed=1, chars=chars_per_domain)
    held["math"] = _math_text(seed=2, chars=heldout_chars)
    return Split(train=train, heldout=held)
