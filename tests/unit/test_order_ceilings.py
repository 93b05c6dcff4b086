"""The id-only ceilings of benchmarks/token_order_share.py: counts per key, layer and rank."""

import importlib.util
import os

import numpy as np

from tests.support import REPO


def _script():
    spec = importlib.util.spec_from_file_location("token_order_share",
                                                  os.path.join(REPO, "benchmarks", "token_order_share.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_id_ceilings_count_each_key_on_each_rank():
    ids = np.array([5, 5, 7, 5])
    prev = np.array([-1, 5, 5, -1])  # the last row starts another request
    topk = np.array([[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[3, 1], [0, 0]], [[1, 1], [3, 2]]])  # [T=4, L=2, K=2]
    e2r = np.array([[0, 0, 1, 1], [1, 0, 1, 0]])  # [L, E]
    mod = _script()
    out = mod._id_ceilings(ids, prev, mod._owners(topk, e2r), 2)
    table, key = out["token"]
    assert key.tolist() == [0, 0, 1, 0]
    # id 5 at layer 0: experts 0,1 | 0,2 | 1,1 -> ranks 0,0 | 0,1 | 0,0
    assert table[0].tolist() == [[5, 1], [1, 1]]
    # layer 1: experts 2,3 | 1,3 | 3,2 -> ranks 1,0 | 0,0 | 0,1 ; id 7: experts 0,0 -> rank 1 twice
    assert table[1].tolist() == [[4, 2], [0, 2]]
    table, key = out["bigram"]
    assert key[0] == key[3] != key[1] and len(set(key.tolist())) == 3  # (-1, 5) twice, (5, 5), (5, 7)
    assert table[0, key[0]].tolist() == [4, 0]  # rows 0 and 3: ranks 0,0 and 0,0
