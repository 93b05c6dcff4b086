"""Runs tests/interp/ in a child process with TRITON_INTERPRET=1 (Triton has no CPU backend:
its interpreter runs the kernels on CPU tensors). The variable must be set before triton is
imported and must not leak into the vLLM processes other tests start, hence the child."""

import os
import subprocess
import sys

import pytest

from tests.support import TESTS

pytest.importorskip("triton")


def test_kernels_match_their_twins_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(TESTS, "interp")], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]


def test_reference_path_without_triton_backend():
    """On CPU tensors without the interpreter, the wrapper runs its token-by-token twin."""
    import torch

    from vllm_smoe.kernels import assign as A

    pref = torch.tensor([[[1, 0], [1, 0], [0, -1]]])  # [1, 3, 2]
    order = torch.tensor([[2, 0, 1]])  # token 2 most confident
    perm, inv = A.assign_permute(pref, order, torch.tensor([2, 1]))
    # token 2 -> rank 0, token 0 -> rank 1 (cap 1), token 1 -> rank 0 (its second choice)
    assert perm.tolist() == [[1, 2, 0]] and inv.tolist() == [[2, 0, 1]]
