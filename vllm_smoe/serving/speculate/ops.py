"""The token order's custom ops (``torch.ops.smoe.*``), registered from one table.

The mutation contract, the same for every op: each is declared ``mutates_args=()`` and returns
fresh tensors, never an input. Its body reads and writes the per-step state of this worker's
token order (permutations, kept rows, the next layer's ranks, counters), not its arguments, and
the ops run in the order data fixes: each consumes an output of the op before it
(``restore_tokens`` what ``order_tokens`` fed the block, the attention what ``fold_residual``
returned, ...), which is why some return a copy of an input rather than the input itself.
torch.compile sees them opaque, with the fake's shapes; a CUDA graph captures what their bodies
launch, on static shapes.
"""

from __future__ import annotations

import torch

from ..served import worker


def _like(x, *rest):
    return torch.empty_like(x)


def _more_columns(y, *rest):  # three columns more: input-gate's two ranks and confidence
    return y.new_empty((y.shape[0], y.shape[1] + 3))


def _fewer_columns(y, *rest):
    return y.new_empty((y.shape[0], y.shape[1] - 3))


# op name -> (schema, the token order's method that runs it, fake)
OPS = {
    "order_tokens": ("(Tensor x, int layer, bool predict) -> Tensor", "order", _like),
    "restore_tokens": ("(Tensor y, int layer) -> Tensor", "restore", _like),
    "reduce_scatter_tokens": ("(Tensor partial, int layer) -> Tensor", "reduce_scatter", _like),
    "note_layer_input": ("(Tensor normed, Tensor x, int layer) -> Tensor", "note_layer_input", _like),
    "fold_residual": ("(Tensor normed, Tensor residual, int layer, bool whole) -> (Tensor, Tensor)", "fold_residual",
                      lambda normed, residual, *rest: (torch.empty_like(normed), torch.empty_like(residual))),
    "fold_residual_ahead": ("(Tensor normed, Tensor residual, int layer, int prev) -> (Tensor, Tensor)",
                            "fold_residual_ahead",
                            lambda normed, residual, *rest: (_more_columns(normed), torch.empty_like(residual))),
    # contiguous, as index_select's output
    "order_folded": ("(Tensor partial, int layer, int prev, bool whole, bool gated) -> Tensor", "order_folded",
                     lambda partial, *rest: partial.new_empty(partial.shape)),
    "split_residual": ("(Tensor x, Tensor residual, int layer) -> (Tensor, Tensor)", "split_residual",
                       lambda x, residual, layer: (torch.empty_like(x), torch.empty_like(residual))),
    "add_residual": ("(Tensor y, int layer) -> Tensor", "add_residual", _like),
    "add_residual_ahead": ("(Tensor y, int layer) -> Tensor", "add_residual_ahead", _more_columns),
    "restore_tokens_ahead": ("(Tensor y, int layer) -> Tensor", "restore_ahead", _fewer_columns),
}


def _register(name: str, schema: str, method: str, fake) -> None:
    def body(*args):
        return getattr(worker().order, method)(*args)

    op = torch.library.custom_op(f"smoe::{name}", body, mutates_args=(), schema=schema)
    op.register_fake(fake)


for _name, (_schema, _method, _fake) in OPS.items():
    _register(_name, _schema, _method, _fake)
