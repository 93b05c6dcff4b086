"""Every test under tests/vllm/ starts vLLM's CPU build: the ``vllm`` marker is set here, once,
so ``pytest -m "not vllm"`` (or ``pytest tests/unit``) runs the fast tests alone."""

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects on the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if os.path.commonpath([str(item.path), HERE]) == HERE:
            item.add_marker(pytest.mark.vllm)
