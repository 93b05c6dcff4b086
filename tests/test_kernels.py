"""Runs tests/interp/ in a child process with TRITON_INTERPRET=1 (Triton has no CPU backend:
its interpreter runs the kernels on CPU tensors). The variable must be set before triton is
imported and must not leak into the vLLM processes other tests start, hence the child."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_shuffle_kernels_match_torch_references_under_the_interpreter():
    here = os.path.dirname(__file__)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(here, "interp")], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]


def test_reference_path_without_triton_backend():
    """On CPU tensors without the interpreter, the wrappers fall back to the torch references."""
    import torch

    from vllm_smoe.kernels import shuffle as S

    perm, counts = S.send_order(torch.tensor([2, 0, 2, 1]), 3)
    assert perm.tolist() == [1, 3, 0, 2] and counts.tolist() == [1, 1, 2]
    y = torch.arange(12.0).reshape(4, 3)
    out = S.combine_topk(y, torch.tensor([[0, 1], [3, -1]]), torch.tensor([[0.5, 0.5], [2.0, 9.0]]))
    assert out.tolist() == [[1.5, 2.5, 3.5], [18.0, 20.0, 22.0]]
