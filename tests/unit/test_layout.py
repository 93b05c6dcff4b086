"""The house rules a newcomer relies on: no import circles between smoe's modules, the pure
placement core imports nothing heavy, and docs/layout.md's table names every package."""

import ast
import os

from tests.support import REPO

ROOTS = {"vllm_smoe": "vllm_smoe", "kernels": "vllm_smoe.kernels", "placement": "vllm_smoe.placement"}


def _modules() -> dict[str, str]:
    """module name -> file, for every module smoe installs."""
    out = {}
    for root, pkg in ROOTS.items():
        for d, _, files in os.walk(os.path.join(REPO, root)):
            if "assets" in d or "__pycache__" in d:
                continue
            rel = os.path.relpath(d, os.path.join(REPO, root))
            base = pkg if rel == "." else pkg + "." + rel.replace(os.sep, ".")
            for f in files:
                if f.endswith(".py"):
                    out[base if f == "__init__.py" else f"{base}.{f[:-3]}"] = os.path.join(d, f)
    return out


def _imports(mod: str, path: str, mods) -> set[str]:
    """smoe modules ``mod`` imports, at any depth of its code (a function-level import is a
    circle too, only a later one)."""
    is_pkg = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = (mod if is_pkg else mod.rsplit(".", 1)[0]).split(".")
                target = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n for n in names if n in mods and n != mod}
    # a package's __init__ is imported with each of its submodules: not an edge of its own
    return {t for t in out if not mod.startswith(t + ".")}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert _cycles(graph) == []
    # the check sees a circle when there is one
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_placement_core_imports_no_torch_vllm_or_smoe_io():
    for mod, path in _modules().items():
        if not mod.startswith("vllm_smoe.placement"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for n in names:
                assert n.split(".")[0] not in ("torch", "vllm", "yaml", "vllm_smoe"), (mod, n)


def test_the_layout_page_names_every_package():
    layout = open(os.path.join(REPO, "docs", "layout.md")).read()
    for mod, path in _modules().items():
        if path.endswith("__init__.py") and mod.startswith("vllm_smoe."):
            rel = os.path.relpath(os.path.dirname(path), REPO)
            name = rel.split(os.sep)[-1]
            assert f"`{rel}/`" in layout or f"`{name}/`" in layout, rel
