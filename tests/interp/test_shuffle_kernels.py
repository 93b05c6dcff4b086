"""Shuffle kernels against their pure-torch references, on irregular sizes.

Runs in its own process with TRITON_INTERPRET=1 set before triton is imported (see
tests/test_kernels.py); indices must match exactly, float combines within a stated tolerance.
"""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_kernels.py (needs TRITON_INTERPRET=1 at import)", allow_module_level=True)

from vllm_smoe.kernels import shuffle as S  # noqa: E402

SIZES = [(1, 1), (7, 3), (129, 5), (300, 8), (513, 2)]  # (tokens, ranks): block edges and tails


@pytest.mark.parametrize("T,N", SIZES)
def test_send_order_matches_stable_counting_sort(T, N):
    g = torch.Generator().manual_seed(T * 31 + N)
    t2r = torch.randint(0, N, (T,), generator=g)
    perm, counts = S.send_order(t2r, N, block=64)
    ref_perm, ref_counts = S.ref_send_order(t2r, N)
    assert torch.equal(perm, ref_perm) and torch.equal(counts, ref_counts)
    assert torch.equal(t2r[perm], torch.sort(t2r).values)


@pytest.mark.parametrize("T,H", [(1, 1), (17, 33), (130, 70)])
def test_pack_rows_is_exact(T, H):
    x = torch.randn(T, H)
    perm = torch.randperm(T)
    assert torch.equal(S.pack_rows(x, perm), x[perm])


@pytest.mark.parametrize("T,K,H", [(1, 1, 8), (9, 3, 33), (64, 8, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_combine_topk_matches_reference(T, K, H, dtype):
    g = torch.Generator().manual_seed(T + K + H)
    M = T * K + 5
    y = torch.randn(M, H, generator=g).to(dtype)
    rows = torch.randint(0, M, (T, K), generator=g)
    rows[0, 0] = -1  # a skipped (token, k)
    w = torch.rand(T, K, generator=g).to(dtype)
    got = S.combine_topk(y, rows, w)
    want = S.ref_combine_topk(y, rows, w)
    # both accumulate in fp32; fp16 outputs differ by at most a rounding of the final cast
    tol = 0 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol if tol else 1e-6)


def test_combine_topk_with_nothing_to_gather():
    """Every (t, k) skipped and y empty (a rank that received no rows): zeros, no read of y."""
    rows = torch.full((5, 3), -1, dtype=torch.long)
    y = torch.empty((0, 9))
    for fn in (S.combine_topk, S.ref_combine_topk):
        out = fn(y, rows, torch.ones(5, 3))
        assert out.shape == (5, 9) and not out.any()


@pytest.mark.parametrize("T,K,E,N", [(1, 1, 4, 2), (33, 4, 32, 4), (200, 8, 64, 8), (77, 6, 60, 6)])
def test_remote_ranks_dedup_is_exact(T, K, E, N):
    g = torch.Generator().manual_seed(T + E)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    e2r = torch.randperm(E, generator=g) % N
    t2r = torch.randint(0, N, (T,), generator=g)
    got = S.remote_ranks(topk, e2r, t2r, N)
    want = S.ref_remote_ranks(topk, e2r, t2r, N)
    assert torch.equal(got, want)
    # de-duplication: never more remote ranks than remote experts
    remote_experts = (e2r[topk] != t2r[:, None]).sum(1)
    assert (got.sum(1) <= remote_experts).all()


def test_golden_send_order():
    perm, counts = S.send_order(torch.tensor([2, 0, 2, 1]), 3)
    assert perm.tolist() == [1, 3, 0, 2] and counts.tolist() == [1, 1, 2]
