"""Every test under tests/vllm/ starts vLLM's CPU build: the ``vllm`` marker is set here, once,
so ``pytest -m "not vllm"`` (or ``pytest tests/unit``) runs the fast tests alone. The plain
server several served tests compare against starts once per run (``plain_served``)."""

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects on the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if os.path.commonpath([str(item.path), HERE]) == HERE:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def plain_served(tmp_path_factory):
    """``answers(prompts) -> [(text, logprobs)]``: plain ``vllm serve`` of the trained fixture
    (vLLM's CPU arguments, no plugin), greedy, 8 tokens, one request at a time. One server,
    started at the first test that asks and stopped before it runs, answers every prompt list
    registered with ``tests.support.plain_prompts``; ``answers.log`` is its log."""
    pytest.importorskip("vllm")
    from vllm_smoe.testbed import FIXTURE_MODEL
    from vllm_smoe.tools.server_process import VllmServer

    from tests.support import PLAIN_PROMPTS

    log = tmp_path_factory.mktemp("plain-server") / "plain.log"
    got = {}
    with VllmServer(FIXTURE_MODEL, log=log) as s:
        for make in PLAIN_PROMPTS:
            prompts = make()
            got.update(zip(map(tuple, prompts), s.complete(prompts)))

    def answers(prompts):
        return [got[tuple(p)] for p in prompts]

    answers.log = str(log)
    return answers
