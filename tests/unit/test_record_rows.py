"""Recording keeps this DP rank's rows of the step, in order, in every layout vLLM runs an MoE layer in
(issue 62, item 3): stand-ins of each layout at DP = 2 x TP = 2 (fake forward contexts with vLLM's
own DPMetadata, a stand-in TP group) drive the recorder's real capture functions, hooks and writer;
the written traces equal a reference routing of the same logits row for row. Never stale rows (a
layer that wrote nothing this step drops the step, counted) and never an exception in the forward."""

import glob
import itertools
import os
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

L, K, E = 2, 2, 8
TP = 2


class _Router:
    capture_fn = None

    def set_capture_fn(self, fn):
        self.capture_fn = fn


class _Layer:
    """vLLM 0.32's FusedMoE as smoe's capture sees it: modular, its router takes a capture function."""

    is_monolithic = False

    def __init__(self):
        self.router = _Router()


class _TPGroup:
    """Stand-in for vLLM's TP group: all_gather of this rank's chunk returns every TP rank's
    chunks of the same step, in rank order (what the real collective returns)."""

    def __init__(self, chunks, rank):
        self.chunks, self.rank, self.calls = chunks, rank, 0

    def all_gather(self, x, dim=0):
        assert dim == 0 and torch.equal(x, self.chunks[self.rank]), "not this rank's chunk"
        self.calls += 1
        return torch.cat(self.chunks)


def _recorder(monkeypatch, rec_dir, dp_rank, tp_rank, max_tokens=16, pcp=1, speculative_config=None):
    import vllm.distributed
    from transformers import Qwen3MoeConfig

    from vllm_smoe.serving.speculate import seams as token_order
    from vllm_smoe.serving.config import SmoeConfig
    from vllm_smoe.serving.record.recorder import Recorder

    layers = [_Layer() for _ in range(L)]
    monkeypatch.setattr(token_order, "find_moe_experts", lambda model, moe: [(i, object(), x) for i, x in
                                                                           enumerate(layers)])
    monkeypatch.setattr(token_order, "hookable_gate", lambda *a: None)
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: tp_rank)
    hf = Qwen3MoeConfig(num_hidden_layers=L, num_experts=E, num_experts_per_tok=K, vocab_size=64, hidden_size=32,
                        decoder_sparse_step=1, mlp_only_layers=[])
    vc = types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_text_config=hf, model="stand-in", enforce_eager=True),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=max_tokens),
        parallel_config=types.SimpleNamespace(data_parallel_rank=dp_rank, tensor_parallel_size=TP,
                                              prefill_context_parallel_size=pcp),
        speculative_config=speculative_config)
    cfg = SmoeConfig(mode="record", record=str(rec_dir), log_interval=1e9, metrics=False)
    return Recorder(torch.nn.Linear(2, 2), vc, cfg, None), [x.router for x in layers]


def _reference(across, seed=0):
    """Per DP rank: its step's routing [rows, L, K] (vLLM's padding rows included), top-k of
    random logits, and its token ids."""
    g = torch.Generator().manual_seed(seed)
    ref = [torch.topk(torch.randn(n, L, E, generator=g), K, dim=-1).indices.to(torch.int32) for n in across]
    ids = [torch.randint(0, 64, (n,), generator=g) for n in across]
    return ref, ids


def _chunks(rows, tp=TP):
    """vLLM's sequence_parallel_chunk: the step padded to a multiple of tp, split in tp chunks."""
    c = -(-rows.shape[0] // tp)
    padded = torch.cat([rows, torch.zeros((c * tp - rows.shape[0], *rows.shape[1:]), dtype=rows.dtype)])
    return list(padded.split(c))


def _router_sees(layout, ref, d, t, layer):
    """[n, K]: what the router of DP rank d, TP rank t routes at ``layer`` in each layout."""
    if layout in ("modular", "no-dp"):  # a modular kernel gathers after routing: this rank's step
        return ref[d][:, layer]
    if layout == "naive":  # MoERunner._maybe_dispatch over the DP group: every DP rank's step
        return torch.cat([r[:, layer] for r in ref])
    if layout == "naive-sp":  # over the EP group, DP-major then TP: every rank's chunk
        return torch.cat([c for r in ref for c in _chunks(r[:, layer])])
    assert layout == "modular-sp"  # sequence_parallel_chunk before a modular kernel: this TP rank's chunk
    return _chunks(ref[d][:, layer])[t]


def _forward_context(layout, across):
    from vllm.forward_context import DPMetadata

    if layout == "no-dp":
        return types.SimpleNamespace(dp_metadata=None)
    return types.SimpleNamespace(dp_metadata=DPMetadata(torch.tensor(across, dtype=torch.int32)))


def _step(rec, routers, layout, ref, ids, real, across, d, t, monkeypatch, req="r", skip_layer=None, rows=None):
    """One served step of DP rank d, TP rank t: hooks before and after a forward whose routers
    see ``layout``'s rows (``rows`` overrides what layer ``skip_layer`` sees; the string "none"
    leaves its capture out)."""
    import vllm.distributed
    from vllm.forward_context import override_forward_context

    from vllm_smoe.serving.runner_hooks import Step

    group = None
    so = types.SimpleNamespace(total_num_scheduled_tokens=real, finished_req_ids=[],
                               scheduled_new_reqs=[types.SimpleNamespace(req_id=req, prompt_token_ids=[0] * real)])
    rec.before_step(None, so)
    ctx = _forward_context(layout, across)
    with override_forward_context(ctx):
        for layer, router in enumerate(routers):
            if layout == "modular-sp":
                group = _TPGroup(_chunks(ref[d][:, layer]), t)
                monkeypatch.setattr(vllm.distributed, "get_tp_group", lambda g=group: g)
                rec.rows._all_gather = None  # resolved again: this layer's stand-in
            seen = _router_sees(layout, ref, d, t, layer)
            if layer == skip_layer:
                if rows == "none":
                    continue
                seen = rows
            if layout == "naive-sp":  # the MoE runner's sequence-parallel context sets the gather sizes
                with ctx.dp_metadata.sp_local_sizes(TP, use_ep=True):
                    router.capture_fn(seen)
            else:
                router.capture_fn(seen)
    if group is not None:
        assert group.calls == 1  # every TP rank joins the gather, writer or not
    step = Step([req], np.array([real]), ids[d][:real], torch.arange(real))
    rec.after_step(None, so, step)


def _recorded(rec_dir, d):
    from vllm_smoe.formats.trace import read_traces

    files = sorted(glob.glob(os.path.join(rec_dir, f"trace-dp{d}-*.npz")))
    return read_traces(files)[1] if files else None


LAYOUTS = ("no-dp", "modular", "naive", "naive-sp", "modular-sp")
LAYOUT_NAMES = {"no-dp": "local", "modular": "local", "naive": "dp-slice", "naive-sp": "sp-gathered",
                "modular-sp": "sp-chunk"}  # record_rows.locate's name of each


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("padded", [False, True], ids=["uneven", "dp-padded"])
def test_each_layout_records_this_dp_ranks_rows_at_dp2_tp2(tmp_path, monkeypatch, layout, padded):
    """Every DP x TP rank drives its own recorder through one step; each DP rank's TP rank 0 writes
    exactly its step's rows, in order, equal to the reference routing; TP rank 1 writes nothing.
    Before: naive dispatch recorded DP rank 0's rows on both DP ranks, sequence parallelism
    recorded the chunk followed by stale rows (zeros here)."""
    real = [5, 3]
    across = [6, 6] if padded else real  # vLLM pads every DP rank to one size for its CUDA graphs
    ref, ids = _reference(across)
    dps = (0,) if layout == "no-dp" else (0, 1)
    for d, t in itertools.product(dps, range(TP)):
        rec, routers = _recorder(monkeypatch, tmp_path, d, t)
        _step(rec, routers, layout, ref, ids, real[d], across, d, t, monkeypatch)
        rec.close()
        assert rec.unrouted == 0 and not rec.rows.missed
        if not padded:  # (padded to a multiple of TP, some layouts share a count, and select the same rows)
            assert rec.rows.layouts == {LAYOUT_NAMES[layout]}
    for d in dps:
        got = _recorded(tmp_path, d)
        np.testing.assert_array_equal(got["token_ids"], ids[d][: real[d]].numpy())
        np.testing.assert_array_equal(got["topk_ids"], ref[d][: real[d]].numpy(), err_msg=f"{layout} DP rank {d}")
    assert len(glob.glob(os.path.join(tmp_path, "trace-*.npz"))) == len(dps)  # TP rank 1 never writes


def test_a_layer_without_this_steps_rows_drops_the_step_never_stale_rows(tmp_path, monkeypatch, caplog):
    """Step 1 is written. In step 2 layer 1 routes a row count no layout has (then: no capture at
    all): its buffer rows are step 1's, so step 2 is dropped whole, counted and logged, and no
    exception reaches the forward. Before, step 2 was written with layer 1's rows from step 1."""
    across = [5, 3]
    ref, ids = _reference(across)
    ref2, ids2 = _reference(across, seed=1)
    rec, routers = _recorder(monkeypatch, tmp_path, 0, 0)
    _step(rec, routers, "modular", ref, ids, 5, across, 0, 0, monkeypatch, req="a")
    with caplog.at_level("WARNING", logger="vllm.smoe"):
        _step(rec, routers, "modular", ref2, ids2, 5, across, 0, 0, monkeypatch, req="b", skip_layer=1,
              rows=torch.zeros((7, K), dtype=torch.int32))
        _step(rec, routers, "modular", ref2, ids2, 5, across, 0, 0, monkeypatch, req="c", skip_layer=1, rows="none")
        rec.drain()
    rec.close()
    assert rec.unrouted == 10 and sum(rec.rows.missed.values()) == 1
    assert "7 rows fit no layout" in caplog.text and "step 1 dropped: MoE layers [1] wrote rows [5, 0]" in caplog.text
    got = _recorded(tmp_path, 0)
    np.testing.assert_array_equal(got["topk_ids"], ref[0].numpy())  # step 1 only
    assert set(got["step_ids"].tolist()) == {0}


def test_rows_past_the_buffer_never_raise_in_the_forward(tmp_path, monkeypatch):
    """Naive dispatch hands every DP rank's rows to the router: 32 rows into a 16-row buffer made
    copy_ raise inside the forward (the engine died). Now this rank's 16 are kept; and rows of no
    layout past the buffer are dropped, counted, never raised."""
    across = [16, 16]
    ref, ids = _reference(across)
    for d in (0, 1):
        rec, routers = _recorder(monkeypatch, tmp_path / "naive", d, 0, max_tokens=16)
        _step(rec, routers, "naive", ref, ids, 16, across, d, 0, monkeypatch)
        rec.close()
        np.testing.assert_array_equal(_recorded(tmp_path / "naive", d)["topk_ids"], ref[d].numpy())
    rec, routers = _recorder(monkeypatch, tmp_path / "odd", 0, 0, max_tokens=16)
    _step(rec, routers, "modular", ref, ids, 16, across, 0, 0, monkeypatch, skip_layer=0,
          rows=torch.zeros((40, K), dtype=torch.int32))
    rec.close()
    assert rec.unrouted == 16 and _recorded(tmp_path / "odd", 0) is None


def test_a_micro_batched_step_is_dropped(tmp_path, monkeypatch):
    """Under DBO each micro-batch routes part of the step at an offset its forward context does
    not carry: such a step is dropped and counted, never written from overlapping rows."""
    import threading

    from vllm.v1.worker import ubatching

    across = [5, 3]
    ref, ids = _reference(across)
    rec, routers = _recorder(monkeypatch, tmp_path, 0, 0)
    monkeypatch.setitem(ubatching._THREAD_ID_TO_CONTEXT, threading.get_ident(), 0)
    _step(rec, routers, "modular", ref, ids, 5, across, 0, 0, monkeypatch)
    rec.close()
    assert rec.unrouted == 5 and any("micro-batched" in r for r in rec.rows.missed)


def test_the_capture_traces_whole_under_torch_compile_at_one_rank(tmp_path, monkeypatch):
    """On the CPU build at one rank vLLM calls the MoE forward directly (no opaque op), so
    torch.compile traces the router's capture into the graph (fullgraph, dynamic rows): it must
    hold no host bookkeeping there (a log call broke vLLM's compiled start), and the compiled
    graph still writes each step's rows and counts."""
    from vllm.forward_context import override_forward_context

    ref, _ = _reference([9])
    rec, routers = _recorder(monkeypatch, tmp_path, 0, 0)

    def forward(x):
        for layer, router in enumerate(routers):
            router.capture_fn(x[:, layer])
        return x + 1

    compiled = torch.compile(forward, fullgraph=True, dynamic=True)
    with override_forward_context(types.SimpleNamespace(dp_metadata=None)):
        for n in (9, 4, 7):
            rec.before_step(None, None)
            compiled(ref[0][:n])
            assert rec.rows.written.tolist() == [n] * L
            assert torch.equal(rec.buf[:n], ref[0][:n])
    rec.close()


def test_prefill_context_parallelism_is_refused_by_value(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="prefill_context_parallel_size 2"):
        _recorder(monkeypatch, tmp_path, 0, 0, pcp=2)


def test_locate_picks_the_intended_rows_wherever_layouts_share_a_count():
    """Every layout, DP 1-3 ranks of 0-9 rows, TP 1, 2, 4: the rows located (the TP gather done
    by hand) are the intended DP rank's step, also where two layouts have the same count."""
    from vllm.forward_context import _compute_sp_num_tokens

    from vllm_smoe.serving.record.rows import locate

    for dp, tp in itertools.product((1, 2, 3), (1, 2, 4)):
        for across in itertools.product(range(10), repeat=dp):
            # row r of DP rank d is d * 100 + r; padding rows -1
            steps = [torch.arange(n) + 100 * d for d, n in enumerate(across)]

            def chunks(s):
                c = -(-s.shape[0] // tp)
                return list(torch.cat([s, torch.full((c * tp - s.shape[0],), -1)]).split(c)) if c else [s[:0]] * tp

            sizes = _compute_sp_num_tokens(torch.tensor(across), tp, 1, True)
            for d, t in itertools.product(range(dp), range(tp)):
                seen = {"local": (steps[d], None), "dp-slice": (torch.cat(steps), None),
                        "sp-gathered": (torch.cat([c for s in steps for c in chunks(s)]), sizes)}
                if tp > 1:
                    seen["sp-chunk"] = (chunks(steps[d])[t], None)
                for name, (rows, local_sizes) in seen.items():
                    where = locate(rows.shape[0], list(across), local_sizes, d, tp)
                    assert where is not None, (name, across, d, t)
                    got = torch.cat(chunks(steps[d])) if where.gather else rows
                    got = got[where.start: where.start + where.count]
                    if where.gather or name != "sp-chunk" or t == 0:
                        # a non-gathering match of a TP rank > 0's chunk (1 row) is never written
                        assert torch.equal(got, steps[d]), (name, where, across, d, t)
    assert locate(7, [5, 3], None, 0, 2) is None
