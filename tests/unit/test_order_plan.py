"""The token order's plan (speculate/plan.py) without buffers or hooks: the start line read from
it for each layout, and the predictor class each plan composes."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm_smoe.serving.speculate import predictors  # noqa: E402
from vllm_smoe.serving.speculate.plan import OrderPlan  # noqa: E402


class Qwen3MoeSparseMoeBlock(torch.nn.Module):
    pass


def _plan(layout, predictor, predicts, **kw):
    blocks = tuple((i, Qwen3MoeSparseMoeBlock(), None) for i in range(2))
    return OrderPlan(2, 0, predictor, predicts, layout, (1, 3), blocks, (None, None), **kw)


@pytest.mark.parametrize("plan,line", [
    (_plan("block", "tables", "tables", shuffle_reason="reduce_scatter: off"),
     "one order per layer, predictor tables; attention output: vLLM's all-reduce (reduce_scatter: off)"),
    (_plan("block", "input-gate", "router", shuffle_reason="reduce_scatter: off"),
     "one order per layer, predictor input-gate (as router: the rows are whole before each block); attention "
     "output: vLLM's all-reduce (reduce_scatter: off)"),
    (_plan("shuffled", "router", "summed-router", shuffled=((0,), (1,)), exact=((None, None),) * 2),
     "one order per layer, predictor router (exact before the reduce: the gate's logits of each rank's partial "
     "rows all-gathered); attention output: reduce-scattered in the token order at 2 MoE layers"),
    (_plan("stack-step", "learned", "learned", step_reason="stack_order: step"),
     "one order per step (stack_order: step), predictor learned; attention output: reduce-scattered by the "
     "decoder layer"),
    (_plan("stack-layer", "input-gate", "input-gate"),
     "one order per layer (the split residual folded into the attention's reduce-scatter), predictor input-gate; "
     "attention output: reduce-scattered by the decoder layer"),
])
def test_the_start_line_is_read_from_the_plan(plan, line):
    assert plan.start_line() == ("smoe: mode speculate: token order over 2 ranks around 2 MoE blocks "
                                 "(Qwen3MoeSparseMoeBlock), " + line)


def test_each_plan_composes_one_predictor_class():
    want = {"random": predictors.RandomRanks, "one-rank": predictors.OneRank, "tables": predictors.TokenTables,
            "tables-markov": predictors.MarkovTables, "learned": predictors.Learned, "router": predictors.Router,
            "summed-router": predictors.SummedRouter, "input-gate": predictors.InputGate}
    for predicts, cls in want.items():
        p = predictors.make_predictor(_plan("block", predicts, predicts))
        assert type(p) is cls
    # what the layouts read of them: per layer, judged, ahead, previous ids
    assert [c.per_layer for c in (predictors.TokenTables, predictors.MarkovTables, predictors.Router,
                                  predictors.InputGate)] == [False, True, True, False]
    assert not predictors.RandomRanks.judged and not predictors.OneRank.judged and predictors.Router.judged
    assert predictors.InputGate.ahead and not predictors.SummedRouter.ahead
    assert predictors.Learned.reads_previous and not predictors.TokenTables.reads_previous
