import numpy as np

from vllm_smoe.placement.stats import domain_specificity, expert_usage, interlayer_precision, token_hotness


def test_token_hotness_golden():
    tok = np.array([0, 0, 0, 1])
    topk = np.array([2, 2, 3, 1]).reshape(4, 1, 1)
    # token 0: top-1 expert (2) takes 2 of 3; token 1: 1 of 1 -> (2 + 1) / 4
    assert token_hotness(tok, topk, min_count=1)[0] == 0.75
    # only token 0 is frequent at min_count=2
    assert np.isclose(token_hotness(tok, topk, min_count=2)[0], 2 / 3)
    assert np.isnan(token_hotness(tok, topk, min_count=5)[0])


def test_interlayer_precision_golden():
    prev = np.array([0, 0, 1, 1])
    cur = np.array([2, 2, 1, 1])
    topk = np.stack([prev, cur], axis=1).reshape(4, 2, 1)
    markov, popular = interlayer_precision(topk, num_experts=3)
    assert markov[0] == 1.0  # 0 -> 2 and 1 -> 1 always
    assert popular[0] == 0.5  # always predicting one expert is right half the time


def test_expert_usage_and_specificity():
    topk = np.array([[0], [0], [1], [1]]).reshape(4, 1, 1)
    dom = np.array([0, 0, 1, 1])
    u = expert_usage(topk, 2, dom, 2)
    np.testing.assert_array_equal(u[:, 0, :], [[1, 0], [0, 1]])
    assert domain_specificity(u)[0] == 0.5  # each domain is 0.5 away from the mean usage
    same = expert_usage(np.zeros((4, 1, 1), int), 2, dom, 2)
    assert domain_specificity(same)[0] == 0.0
