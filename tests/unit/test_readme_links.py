"""The docs a newcomer reads hold together: every number-bearing row of the README's "where it
pays" table links to a measured section (an existing heading of BENCHMARKS.md or a page under
docs/benchmarks/), and every relative link in README.md, BENCHMARKS.md and docs/ resolves, anchors
included (GitHub's heading anchors). No vLLM."""

import glob
import os
import re

import pytest

from tests.support import REPO

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """Every heading anchor of a markdown file (fenced code skipped; repeats get -1, -2 as on GitHub)."""
    seen: dict[str, int] = {}
    out, fenced = set(), False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            a = anchor(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


def resolve(src: str, target: str):
    """(file, anchor or None) a relative link from ``src`` names; None for links off the repository."""
    if re.match(r"[a-z]+:", target):
        return None
    path, _, frag = target.partition("#")
    full = os.path.normpath(os.path.join(os.path.dirname(src), path)) if path else src
    return full, frag or None


def broken(src: str) -> list[str]:
    bad = []
    text = open(src, encoding="utf-8").read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code are not links
    for target in LINK.findall(text):
        r = resolve(src, target)
        if r is None:
            continue
        full, frag = r
        if not os.path.exists(full):
            bad.append(f"{target}: no such file")
        elif frag and full.endswith(".md") and frag not in anchors(full):
            bad.append(f"{target}: no such heading")
    return bad


def pays_rows() -> list[str]:
    """The README's "where it pays" table (under "Will smoe pay on my cluster?"): its body rows."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    sec = text[text.index("## Will smoe pay on my cluster?"):]
    sec = sec[:sec.index("\n## ", 1)]
    rows = [line for line in sec.splitlines() if line.startswith("|")]
    return rows[2:]  # header and rule


def test_every_number_in_the_where_it_pays_table_links_to_its_measurement():
    rows = pays_rows()
    assert len(rows) >= 5
    for row in rows:
        if not re.search(r"\d", row):
            continue
        targets = [t for t in LINK.findall(row) if t.split("#")[0].endswith(".md")]
        measured = [t for t in targets if t.startswith(("BENCHMARKS.md#", "docs/benchmarks/")) and "#" in t]
        assert measured, f"a row with numbers links to no BENCHMARKS section:\n{row}"
        for t in measured:
            path, frag = t.split("#", 1)
            full = os.path.join(REPO, path)
            assert os.path.exists(full), f"{t}: no such file"
            assert frag in anchors(full), f"{t}: no such heading in {path}"


@pytest.mark.parametrize("src", ["README.md", "BENCHMARKS.md", *sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))])
def test_relative_links_resolve(src):
    assert broken(os.path.join(REPO, src)) == []


def test_the_readme_stays_a_landing_page():
    assert sum(1 for _ in open(os.path.join(REPO, "README.md"), encoding="utf-8")) <= 300
