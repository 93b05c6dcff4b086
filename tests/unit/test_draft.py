"""Speculative decoding: smoe's loader leaves a draft model to vLLM. Stand-ins for vLLM's configs,
shaped as vLLM 0.32 and 0.33 build them (``config/speculative.py``, ``v1/spec_decode/*.py``)."""

import dataclasses
import logging
from types import SimpleNamespace

import pytest

from vllm_smoe.serving.place.draft import is_draft, start_line


@dataclasses.dataclass
class _Vllm:  # the fields of VllmConfig the detection reads; dataclasses.replace as the proposers call it
    model_config: object
    speculative_config: object | None
    additional_config: dict = dataclasses.field(default_factory=dict)


def _model(runner_type="generate", model="target"):
    return SimpleNamespace(runner_type=runner_type, model=model)


def _configs(method):
    """(target's vLLM config, the draft's ModelConfig or None) as vLLM builds them for ``method``."""
    target = _model()
    if method in ("ngram", "suffix", "custom_class"):  # no draft model: draft_model_config is the target's
        draft = None
        spec = SimpleNamespace(method=method, target_model_config=target, draft_model_config=target)
    elif method == "extract_hidden_states":  # copy.copy of the target's, runner unchanged
        draft = SimpleNamespace(**vars(target))
        spec = SimpleNamespace(method=method, target_model_config=target, draft_model_config=draft)
    else:  # ModelConfig(runner="draft", ...)
        draft = _model("draft", "draft")
        spec = SimpleNamespace(method=method, target_model_config=target, draft_model_config=draft)
    return _Vllm(target, spec), draft


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3", "mtp", "medusa", "extract_hidden_states",
                                    "ngram", "suffix"])
def test_the_target_is_the_target_and_every_draft_a_draft(method):
    vllm_config, draft = _configs(method)
    # the target: CPU/GPU model runners call get_model(vllm_config=...) -> model_config = vllm_config.model_config
    assert not is_draft(vllm_config, vllm_config.model_config)
    if draft is None:
        return
    # EAGLE, MTP, Medusa, extract_hidden_states: get_model(vllm_config=<the target's or a kernel-level copy>,
    # model_config=speculative_config.draft_model_config)
    assert is_draft(dataclasses.replace(vllm_config), draft)
    if method == "draft_model":  # draft_model.py / standalone_ar: replace(vllm_config, model_config=draft), no model_config
        drafts_own = dataclasses.replace(vllm_config, model_config=draft)
        assert drafts_own.model_config is draft  # what made `model_config is vllm_config.model_config` say target
        assert is_draft(drafts_own, drafts_own.model_config)


def test_no_speculative_config_no_draft():
    target = _model("draft")  # even a model config that says draft: without --speculative-config it is served
    assert not is_draft(_Vllm(target, None), target)


class _Router:
    def set_capture_fn(self, fn):
        pass


def _moe_model(experts):
    torch = pytest.importorskip("torch")
    model = torch.nn.Module()
    for i, e in enumerate(experts):  # vLLM 0.32's MoERunner: the count on its routed_experts
        layer = torch.nn.Module()
        layer.router, layer.routed_experts = _Router(), SimpleNamespace(global_num_experts=e)
        model.add_module(f"l{i}", layer)
    return model


def test_start_line_says_what_smoe_does_with_a_drafts_moe_layers():
    vllm_config, draft = _configs("draft_model")
    line = start_line(_moe_model([64, 64]), vllm_config, draft)
    assert "draft draft (method draft_model)" in line and "2 MoE layers (64 experts)" in line
    assert "served as vLLM serves them" in line
    assert start_line(_moe_model([]), vllm_config, draft).endswith("(it has no MoE layers)")


def test_the_loader_hands_a_draft_to_vllm_and_builds_nothing_around_it(monkeypatch, caplog):
    """A 64-expert draft of a placed 32-expert target: vLLM's load, no placement parsed for it, no
    worker state, no recorder (before: the placement was planned against the draft and refused,
    or a recorder and worker were built for it and replaced the target's)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from vllm_smoe.serving.place import loader
    from vllm_smoe.serving import served

    model = _moe_model([64])
    calls = []
    monkeypatch.setattr(DefaultModelLoader, "load_model", lambda self, vc, mc, prefix="": calls.append(mc) or model)

    def refuse(*a, **k):
        raise AssertionError("smoe's target-side setup ran for a draft")

    monkeypatch.setattr(loader, "placement_for", refuse)
    monkeypatch.setattr(loader, "start_worker", refuse)
    monkeypatch.setattr(served, "_WORKER", None)
    vllm_config, draft = _configs("draft_model")
    vllm_config.additional_config = {"smoe": {"mode": "record", "record": "/nonexistent"}}
    ldr = object.__new__(loader.SmoeModelLoader)  # its __init__ needs vLLM's LoadConfig; unused here
    ldr.plan = None
    with caplog.at_level(logging.INFO, logger="vllm.smoe"):
        assert ldr.load_model(dataclasses.replace(vllm_config, model_config=draft), draft) is model
    assert calls == [draft] and served.worker() is None and ldr.plan is None
    assert "1 MoE layers (64 experts) are served as vLLM serves them" in caplog.text
