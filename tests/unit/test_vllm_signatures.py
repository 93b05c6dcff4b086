"""Every vLLM symbol smoe patches or reads has, in every supported vLLM release, the kind and
parameters smoe's lists expect: checked against ``serving/patches/signatures.json``, which
``python -m vllm_smoe.tools.vllm_signatures`` writes from each release's wheel (parsed, not
installed). The reader is itself checked against the installed vLLM, by its sources and by
``inspect``."""

import copy
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

from vllm_smoe.serving import patches
from vllm_smoe.tools import vllm_signatures as vs


def test_every_supported_release_has_what_smoe_expects():
    stored = vs.load()
    assert sorted(stored) == sorted(patches.SUPPORTED_VLLM)
    assert vs.drift(stored) == []
    # each stored release covers exactly the targets listed now (a new patch needs the file regenerated)
    for version in patches.SUPPORTED_VLLM:
        assert sorted(stored[version]["symbols"]) == sorted(vs.targets()), version


def test_every_patch_and_private_read_is_checked_on_every_supported_release():
    for p in patches.PATCHES:
        assert set(p.checked_on) >= set(patches.SUPPORTED_VLLM), p.id
    assert sorted(patches.PRIVATE_READ_SIGNATURES) == sorted(t for t, _, _ in patches.PRIVATE_READS)


def test_the_gpu_extra_takes_exactly_the_supported_releases():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
        (gpu,) = tomllib.load(f)["project"]["optional-dependencies"]["gpu"]
    spec = Requirement(gpu).specifier
    released = ["0.31.0", "0.32.0", "0.33.0", "0.34.0"]  # on PyPI when this was written
    assert [v for v in released if v in spec] == list(patches.SUPPORTED_VLLM)


def test_a_release_that_moves_a_symbol_fails():
    stored = copy.deepcopy(vs.load())
    symbols = stored["0.33.0"]["symbols"]
    renamed = "vllm.engine.arg_utils:EngineArgs.create_engine_config"
    symbols[renamed] = dict(symbols[renamed], params=["self", "usage_context", "headless_mode"])
    gone = "vllm.distributed.device_communicators.cpu_communicator:_CPUSHMDistributed"
    symbols[gone] = None
    made_property = "vllm.engine.arg_utils:EngineArgs.create_load_config"
    symbols[made_property] = dict(symbols[made_property], kind="property")
    overridden = "vllm.model_executor.model_loader.default_loader:DefaultModelLoader._init_ep_weight_filter"
    symbols[overridden] = dict(symbols[overridden], params=["self", "model_config", "load_config"])
    unread = "vllm.model_executor.layers.fused_moe.runner.moe_runner:_moe_forward"
    symbols[unread] = dict(symbols[unread], params=["x"])  # smoe only compares it by identity
    lines = vs.drift(stored)
    assert len(lines) == 4, lines
    for target in (renamed, gone, made_property, overridden):
        assert sum(line.startswith(target + ":") and "0.33.0" in line for line in lines) == 1, target
    del stored["0.32.0"], symbols[made_property]
    lines = vs.drift(stored)
    assert any(line.startswith("vLLM 0.32.0: not in") for line in lines)
    assert any(line.startswith(made_property + ": not stored for vLLM 0.33.0") for line in lines)


_FAKE = textwrap.dedent('''
    import functools

    def wraps_it(f):
        @functools.wraps(f)
        def inner(*a, **k):
            return f(*a, **k)
        return inner

    try:
        class Engine:
            def __init__(self, a, /, b, *rest, c=1, **kw):
                pass

            @staticmethod
            def build(parser):
                pass

            @functools.cached_property
            def cached(self):
                pass

            @property
            def flag(self):
                return True

            @wraps_it
            def step(self, batch, extra=None):
                pass
    except ImportError:
        Engine = None

    if False:
        def helper(x):
            pass
    else:
        def helper(x, y):
            pass
''')


def _wheel(tmp_path, version="9.9.9+cpu", source=_FAKE):
    path = tmp_path / "vllm-fake.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/__init__.py", "")
        z.writestr("vllm/fake/mod.py", source)
        z.writestr(f"vllm-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return str(path)


def test_the_reader_parses_what_python_would_define(tmp_path):
    z = zipfile.ZipFile(_wheel(tmp_path))
    z.extractall(tmp_path / "src")
    root = str(tmp_path / "src")
    got = {t: vs.describe(root, "vllm.fake.mod:" + t) for t in
           ("Engine", "Engine.__init__", "Engine.build", "Engine.flag", "Engine.step", "Engine.cached", "helper",
            "Engine.gone", "nothing.here")}
    assert got["Engine"] == {"kind": "class", "params": ["self", "a", "b", "rest", "c", "kw"],
                             "signature": "(self, a, /, b, *rest, c=1, **kw)"}
    assert got["Engine.__init__"]["kind"] == "__init__"
    assert got["Engine.build"] == {"kind": "staticmethod", "params": ["parser"], "signature": "(parser)"}
    assert got["Engine.flag"]["kind"] == "property" and got["Engine.flag"]["params"] == ["self"]
    assert got["Engine.step"]["params"] == ["self", "batch", "extra"]  # wraps: inspect follows __wrapped__
    assert got["Engine.cached"]["kind"] == "cached_property"  # not to pass as a property or a method
    assert got["helper"]["params"] == ["x", "y"]  # the later definition, as the module leaves it
    assert got["Engine.gone"] is None and got["nothing.here"] is None
    assert vs.describe(root, "vllm.nomodule:f") is None


def test_a_name_a_module_imports_is_described_where_it_is_defined(tmp_path):
    """vLLM's iterators call ``should_skip_weight`` through weight_utils' import of it, which is
    what smoe replaces: absolute and relative imports are followed to the def."""
    z = zipfile.ZipFile(_wheel(tmp_path))
    z.extractall(tmp_path / "src")
    fake = tmp_path / "src" / "vllm" / "fake"
    (fake / "__init__.py").write_text("from .mod import helper as pkg_helper\n")
    (fake / "user.py").write_text("from vllm.fake.mod import helper\nfrom .mod import Engine as E\n"
                                  "from . import mod\nfrom .missing import gone\n")
    root = str(tmp_path / "src")
    assert vs.describe(root, "vllm.fake.user:helper")["params"] == ["x", "y"]
    assert vs.describe(root, "vllm.fake.user:E")["kind"] == "class"  # a module's name only (not E.build)
    assert vs.describe(root, "vllm.fake:pkg_helper")["params"] == ["x", "y"]
    assert vs.describe(root, "vllm.fake.user:mod") is None and vs.describe(root, "vllm.fake.user:gone") is None


def test_the_generator_reads_a_wheel_without_installing_it(tmp_path):
    version, symbols = vs.read_wheel(_wheel(tmp_path))
    assert version == "9.9.9"  # a build's local tag (+cpu) names the same release
    assert list(symbols) == vs.targets() and set(symbols.values()) == {None}
    out = tmp_path / "signatures.json"
    out.write_text(json.dumps({"0.1.0": {"wheel": "old.whl", "symbols": {}}}))
    assert vs.main(["--wheel", _wheel(tmp_path), "--out", str(out)]) == 0
    written = vs.load(str(out))
    assert sorted(written) == ["0.1.0", "9.9.9"] and written["9.9.9"]["wheel"] == "vllm-fake.whl"
    assert out.read_text() == vs.dumps(written)
    bad = tmp_path / "other.whl"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("other/__init__.py", "")
    with pytest.raises(ValueError, match="other.whl"):
        vs.read_wheel(str(bad))


def _installed_vllm():
    """(release, the directory holding the installed ``vllm`` package), without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    from importlib.metadata import version

    return vs._release(version("vllm")), os.path.dirname(os.path.dirname(spec.origin))


def test_the_stored_release_is_what_the_installed_build_defines():
    """The stored 0.32.0 entry was read from the CUDA wheel; the CPU build installed here is an
    independent copy of the same release."""
    release, root = _installed_vllm()
    stored = vs.load()
    if release not in stored:
        pytest.skip(f"vLLM {release} installed, not a supported release")
    assert vs.read_tree(root) == stored[release]["symbols"]


_INSPECT = textwrap.dedent('''
    import inspect, json
    from vllm_smoe.serving import patches
    from vllm_smoe.tools import vllm_signatures as vs
    out = {}
    for target in vs.targets():
        owner, attr = patches._resolve(target)
        obj = inspect.getattr_static(owner, attr)
        out[target] = [None if inspect.isclass(obj) else type(obj).__name__, patches._params(obj)]
    print(json.dumps(out))
''')


def test_the_reader_agrees_with_inspect_on_the_installed_build():
    """What the ast reader finds is what ``patches`` sees at run time (imported, decorators and all)."""
    _, root = _installed_vllm()
    r = subprocess.run([sys.executable, "-c", _INSPECT], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    wrapper = {"staticmethod": "staticmethod", "classmethod": "classmethod", "property": "property"}
    for target, read in vs.read_tree(root).items():
        kind, params = seen[target]
        if read["kind"] == "class":  # inspect's signature of a class drops self
            assert kind is None and params == read["params"][1:], target
        else:
            assert params == read["params"], target
            assert kind == wrapper.get(read["kind"], "function"), target
