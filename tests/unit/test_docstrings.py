"""Module docstrings say what a module does and why in at most 15 lines; the details go into the
docstrings of the classes and functions they describe, measurements and history into
docs/history.md. Plain ast: no module is imported."""

import ast
import os

from tests.support import REPO

ROOTS = ("vllm_smoe", "kernels", "placement")
MAX_LINES = 15


def _modules():
    for root in ROOTS:
        for d, dirs, files in os.walk(os.path.join(REPO, root)):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    yield os.path.join(d, f)


def test_module_docstrings_at_most_15_lines():
    long = []
    for path in _modules():
        with open(path, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read(), filename=path))
        if doc and len(doc.splitlines()) > MAX_LINES:
            long.append(f"{os.path.relpath(path, REPO)}: {len(doc.splitlines())} lines")
    assert not long, ("module docstrings over %d lines (move the details into the class or function they "
                      "describe, history to docs/history.md):\n" % MAX_LINES) + "\n".join(long)


def test_history_anchors_exist():
    """Every ``docs/history.md#anchor`` a module points at names one of the page's headings."""
    with open(os.path.join(REPO, "docs", "history.md"), encoding="utf-8") as f:
        headings = [line[3:].strip() for line in f if line.startswith("## ")]
    anchors = {"".join(c for c in h.lower() if c.isalnum() or c in "-_ ").replace(" ", "-") for h in headings}
    missing = []
    for path in _modules():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for part in text.split("docs/history.md#")[1:]:
            anchor = part.split()[0].rstrip(").,;:`'\"")
            if anchor not in anchors:
                missing.append(f"{os.path.relpath(path, REPO)}: #{anchor}")
    assert not missing, "links to docs/history.md without a heading of that name:\n" + "\n".join(missing)
