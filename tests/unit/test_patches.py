"""The one list of vLLM patches (``vllm_smoe.serving.patches``) is complete and true: every
symbol smoe replaces is listed, each listed original has the parameters the patch was written
for, and a symbol that differs is refused, named, before anything is served."""

import os
import subprocess
import sys
import textwrap
import types

import pytest

pytest.importorskip("vllm")  # the list is checked against the installed vLLM

from tests.support import REPO  # noqa: E402
from vllm_smoe.serving import patches  # noqa: E402

# Applies every patch smoe can make (start-time and lazy ones), then looks for smoe's code on
# vLLM's modules and classes: what is there but not listed is an unlisted patch.
_SCAN = textwrap.dedent('''
    import inspect, json, sys
    from vllm_smoe.serving import patches, plugin, runner_hooks
    from vllm_smoe.serving.patches import cli, cpu
    import vllm.entrypoints.cli.serve  # noqa: F401 (the serve command is patched only where imported)

    plugin.register()
    cli.install()
    cpu.in_worker()
    runner_hooks.attach()
    from vllm_smoe.serving.place import expert_filter
    from vllm_smoe.serving.patches import model_loader
    model_loader.install(expert_filter.should_skip)  # the loader's, where a placement meets vLLM's EP filter

    def scan():
        found = {}
        for name, mod in list(sys.modules.items()):
            if not name.startswith("vllm.") or mod is None:
                continue
            owners = [(f"{name}:", vars(mod))]
            owners += [(f"{name}:{c.__qualname__}.", vars(c)) for c in list(vars(mod).values())
                       if inspect.isclass(c) and c.__module__ == name]
            for prefix, attrs in owners:
                for attr, obj in list(attrs.items()):
                    if isinstance(obj, (staticmethod, classmethod)):
                        fn = obj.__func__
                    elif isinstance(obj, property):
                        fn = obj.fget
                    elif inspect.isfunction(obj) or inspect.isclass(obj):
                        fn = obj
                    else:
                        continue
                    if str(getattr(fn, "__module__", "")).startswith("vllm_smoe"):
                        found[prefix + attr] = getattr(fn, "_smoe_patch", None)
        return found

    listed = {p.id: p.target for p in patches.PATCHES}
    found = scan()
    unlisted = sorted(t for t, pid in found.items() if pid is None or listed.get(pid) != t)
    from vllm.config import ParallelConfig
    from vllm_smoe.serving import served
    ParallelConfig._smoe_probe = served.worker  # an unlisted patch: the scan must see it
    caught = sorted(t for t, pid in scan().items() if pid is None)
    print(json.dumps({"found": found, "unlisted": unlisted, "applied": sorted(patches.applied()),
                      "caught": caught, "mismatches": patches.mismatches(import_all=True)}))
''')


@pytest.fixture(scope="module")
def scan():
    import json

    r = subprocess.run([sys.executable, "-c", _SCAN], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_every_replacement_of_a_vllm_symbol_is_listed(scan):
    assert scan["unlisted"] == []
    assert scan["caught"] == ["vllm.config.parallel:ParallelConfig._smoe_probe"]  # the scan sees one
    # every listed patch that applies on this build was applied, and found where it is listed
    optional = {p.id for p in patches.PATCHES if p.optional or p.platform not in ("", "cpu")}  # CPU build here
    assert set(scan["applied"]) | optional >= {p.id for p in patches.PATCHES}
    assert sorted(scan["found"].values()) == sorted(scan["applied"])


def test_listed_originals_are_what_the_patches_were_written_for(scan):
    assert scan["mismatches"] == []


def test_a_changed_symbol_is_refused_and_named(monkeypatch):
    mod = types.ModuleType("fakevllm")

    class C:
        def f(self, x, y):
            return x + y

    C.__module__, C.__qualname__ = "fakevllm", "C"
    mod.C = C
    p = patches.Patch("fake_f", "fakevllm:C.f", "method", ("self", "x"), "tests", "why", "none", "never")
    monkeypatch.setitem(patches._BY_ID, "fake_f", p)
    monkeypatch.setattr(patches, "_MISMATCHES", {})
    monkeypatch.setattr(patches, "_ORIGINALS", {})

    def new(self, x):
        return x

    assert patches.replace("fake_f", C, "f", new) is False
    assert C.__dict__["f"] is not new  # vLLM's own stays
    (line,) = patches.mismatches()
    assert "fakevllm:C.f" in line and "('self', 'x', 'y')" in line
    assert patches.check("fake_f", C, "f") == line and patches.check("fake_f", C, "gone").endswith("not in this vLLM")
    with pytest.raises(ValueError, match="fakevllm:C.f"):
        patches.require("fake_f", C, "f", new)


def test_a_listed_symbol_is_replaced_once_and_its_original_kept(monkeypatch):
    class C:
        def f(self, x):
            return x

    C.__module__, C.__qualname__ = "fakevllm", "C"
    orig = C.__dict__["f"]
    p = patches.Patch("fake_g", "fakevllm:C.f", "method", ("self", "x"), "tests", "why", "none", "never")
    monkeypatch.setitem(patches._BY_ID, "fake_g", p)
    monkeypatch.setattr(patches, "_ORIGINALS", {})

    def new(self, x):
        return orig(self, x) + 1

    assert patches.replace("fake_g", C, "f", new) and patches.replace("fake_g", C, "f", new)
    assert C().f(1) == 2 and patches.original("fake_g") is orig  # once: not wrapped twice
    with pytest.raises(AssertionError, match="not in serving/patches"):
        patches.replace("nobody_listed_this", C, "f", new)


def test_every_entry_says_why_and_how_it_goes():
    ids = [p.id for p in patches.PATCHES]
    assert len(ids) == len(set(ids))
    for p in patches.PATCHES:
        assert ":" in p.target and p.why and p.remove and p.upstream and p.checked_on, p.id


def test_a_server_refuses_to_start_naming_each_changed_symbol(monkeypatch):
    from vllm_smoe.serving import plugin
    from vllm_smoe.serving.config import SmoeSettingsError

    said = ["vllm.a:B.c: vLLM's has parameters ('self',), smoe's patch was written for ('self', 'x')",
            "vllm.d:e: not in this vLLM (AttributeError: e)"]
    monkeypatch.setattr(patches, "mismatches", lambda check_all=False: said if check_all else [])
    with pytest.raises(SmoeSettingsError) as e:
        plugin._before_engine_config(types.SimpleNamespace(additional_config={"smoe": {}}))
    assert all(s in str(e.value) for s in said)
    # a server that does not ask for smoe is left alone
    assert plugin._before_engine_config(types.SimpleNamespace(additional_config={})) is None


# ---- changes to vLLM that replace no symbol (patches/interventions.py) ----

def _where_files(iv):
    import re

    return re.findall(r"[\w/]+\.py", iv.where)


def test_every_intervention_says_why_how_it_goes_and_where_it_lives():
    from vllm_smoe.serving.patches import interventions

    ids = [iv.id for iv in interventions.INTERVENTIONS]
    assert len(ids) == len(set(ids))
    serving = os.path.join(REPO, "vllm_smoe", "serving")
    for iv in interventions.INTERVENTIONS:
        assert iv.what and iv.why and iv.upstream and iv.remove and iv.modes and iv.checked_on, iv.id
        assert set(iv.modes) <= {"place", "record", "speculate"}, iv.id
        files = _where_files(iv)
        assert files and all(os.path.exists(os.path.join(serving, f)) for f in files), (iv.id, iv.where)


def test_every_fact_an_intervention_relies_on_holds_in_the_installed_vllm():
    from vllm_smoe.serving.patches import interventions

    assert interventions.mismatches({"place", "record", "speculate"}, models=True) == []


def test_a_fact_that_no_longer_holds_is_named_with_its_intervention(monkeypatch):
    from vllm_smoe.serving.patches import interventions as ivs

    bad = ivs.Intervention("fake", "w", "plugin.py", "y", "u", "r", ("speculate",), checks=(
        ivs.Check("vllm.forward_context:ForwardContext", attr="no_such_field"),
        ivs.Check("vllm.model_executor.layers.linear:RowParallelLinear.forward", source=("no such line",)),
        ivs.Check("vllm.model_executor.layers.fused_moe.router.base_router:BaseRouter._compute_routing",
                  params=("self",)),
        ivs.Check("vllm.forward_context:NoSuchThing"),
        ivs.Check("vllm.model_executor.models.qwen3_moe:Qwen3MoeSparseMoeBlock.forward", source=("gone(",),
                  model=True)))
    monkeypatch.setattr(ivs, "INTERVENTIONS", (bad,))
    lines = ivs.mismatches({"speculate"})
    assert len(lines) == 4 and all(line.startswith("fake (plugin.py): ") for line in lines)
    assert "no_such_field" in lines[0] and "no such line" in lines[1] and "('self',)" in lines[2]
    assert "not in this vLLM" in lines[3]
    assert ivs.mismatches({"place"}) == []  # only the modes that make it
    (model,) = ivs.model_mismatches({"speculate"})
    assert "Qwen3MoeSparseMoeBlock.forward" in model and "gone(" in model


def test_a_server_refuses_to_start_when_an_intervention_cannot_hold(monkeypatch):
    from vllm_smoe.serving import plugin
    from vllm_smoe.serving.config import SmoeSettingsError
    from vllm_smoe.serving.patches import interventions

    monkeypatch.setattr(patches, "mismatches", lambda check_all=False: [])
    monkeypatch.setattr(interventions, "mismatches",
                        lambda modes, models=False: [f"x ({sorted(modes)}): vllm.a:B has no attribute 'c'"])
    with pytest.raises(SmoeSettingsError, match="has no attribute 'c'") as e:
        plugin._before_engine_config(types.SimpleNamespace(additional_config={"smoe": {}}))
    assert "['place']" in str(e.value)  # the modes this config makes


PATCHES_DOC = os.path.join(REPO, "docs", "patches.md")


def test_the_docs_table_lists_every_intervention():
    from vllm_smoe.serving.patches import interventions

    doc = open(PATCHES_DOC).read()
    for iv in interventions.INTERVENTIONS:
        row = f"| {iv.what} | `serving/{iv.where}` | {iv.why} | {iv.remove} |"
        assert row in doc, f"docs/patches.md's table of changes to vLLM lacks (or has another) row for {iv.id}:\n{row}"


def patch_rows() -> list[str]:
    """docs/patches.md's full list, one row per entry of PATCHES (the short table above it is prose)."""
    return [f"| `{p.id}` | `{p.target}` | `serving/{p.where}` | {p.remove} |" for p in patches.PATCHES]


def test_the_docs_list_has_every_patch_and_no_other():
    doc = open(PATCHES_DOC).read()
    full = doc[doc.index("### Every entry of `PATCHES`"):]
    full = full[:full.index("\n#") if "\n#" in full else len(full)]
    rows = [line for line in full.splitlines() if line.startswith("| `")]
    assert rows == patch_rows(), ("docs/patches.md's list differs from PATCHES; its rows are:\n"
                                  + "\n".join(patch_rows()))
