"""vLLM's expert parallelism through the plugin and mode speculate on vLLM's CPU build: greedy
tokens identical to plain vLLM (fp32, 32 held-out prompts), logprobs within fp32 summation noise."""

import json
import os
import re
import shutil

import numpy as np
import pytest

from vllm_smoe.testbed import FIXTURE_MODEL, FIXTURE_TRACES
from tests.support import REPO, heldout_prompts, vllm_runs
from tests.unit.test_speculate import EP2

EP2_R4 = os.path.join(REPO, "configs", "tiny-4dom-ep2-r4.yaml")  # the same build with 4 copies per layer


def _prompts(n):
    """n held-out requests, prompt lengths 3..34 tokens."""
    return heldout_prompts(n)


@pytest.fixture(scope="module")
def learned_ep2(tmp_path_factory):
    from vllm_smoe.testbed import FIXTURE_MODEL as model
    from vllm_smoe.tools.place_cli import main as place

    out = str(tmp_path_factory.mktemp("learned") / "ep2.yaml")
    assert place(["build", "--trace", FIXTURE_TRACES["train"], "--ep-size", "2", "--model", model, "--learned",
                  "-o", out]) == 0
    return out


# Logprob tolerance: with expert parallelism each expert runs whole on one rank, plain TP=2 splits
# its intermediate dimension over two ranks and all-reduces, so fp32 sums differ in order (~1e-6).
ATOL = 1e-4
# reduce_scatter on: the shuffled reduce-scatter on one node too (auto takes it only across nodes)
SPEC = {"mode": "speculate", "placement": EP2, "log_interval": 0.2, "reduce_scatter": "on"}


# id: (smoe settings, compiled, what the log says), each served at TP=2 + EP against plain TP=2
CASES = {
    "vllm-ep": ({"all2all": "vllm", "log_interval": 0.2}, False, None),  # vLLM's own EP, experts fixed by the plugin
    "tables": ({**SPEC, "predictor": "tables"}, False, "predictor tables"),
    "tables-markov": ({**SPEC, "predictor": "tables-markov"}, False, "predictor tables-markov"),
    # vLLM's gate run ahead: exact ranks; under the shuffled reduce-scatter its logits summed from
    # each rank's partial rows before the reduce, else on the all-reduced rows
    "router": ({**SPEC, "predictor": "router"}, False, "predictor router"),
    "router-compiled": ({**SPEC, "predictor": "router"}, True, "predictor router"),
    "router-allreduce": ({**SPEC, "predictor": "router", "reduce_scatter": "off"}, False, "predictor router"),
    # the gate on each layer's input, its ranks in the previous block's all-gather: no collective more
    "input-gate": ({**SPEC, "predictor": "input-gate"}, False, "predictor input-gate"),
    "input-gate-compiled": ({**SPEC, "predictor": "input-gate"}, True, "predictor input-gate"),
    "random": ({**SPEC, "predictor": "random"}, False, "predictor random"),
    "learned": ({**SPEC, "placement": "learned", "predictor": "learned"}, False, "predictor learned"),  # --learned
    "tables-agrs": ({**SPEC, "predictor": "tables", "all2all": "vllm"}, False, "predictor tables"),  # allgather-RS
    "tables-compiled": ({**SPEC, "predictor": "tables"}, True, "predictor tables"),  # smoe's ops stay opaque
    "replicas": ({**SPEC, "placement": EP2_R4, "predictor": "tables"}, False, "predictor tables"),  # own copies
    "replicas-router": ({**SPEC, "placement": EP2_R4, "predictor": "router"}, False, "predictor router"),
}
# cases served with vLLM's EP weight filter on (fed each rank's placed slots): a rank reads its
# placed experts only; the others, same placements, read every expert
FILTERED = ("tables", "replicas")


@pytest.fixture(scope="module")
def served_tp2(tmp_path_factory, learned_ep2):
    """Plain TP=2 and every case of CASES on 32 held-out prompts, the engines one after another in
    one process: (prompts, plain result, {case id: (result, log)})."""
    pytest.importorskip("vllm")
    prompts = _prompts(32)
    runs = [{"model": FIXTURE_MODEL, "prompts": prompts, "max_tokens": 8, "extra": None, "ep": False}]
    for case, (smoe, compiled, _) in CASES.items():
        if smoe.get("placement") == "learned":  # an EP 2 placement whose tables carry the learned predictor
            smoe = {**smoe, "placement": learned_ep2}
        runs.append({"model": FIXTURE_MODEL, "prompts": prompts, "max_tokens": 8, "extra": {"smoe": smoe},
                     "ep": True, "compiled": compiled, "engine": {"enable_ep_weight_filter": case in FILTERED}})
    results = vllm_runs(runs, tmp_path_factory.mktemp("tp2"), tp=2)
    return prompts, results[0][0], dict(zip(CASES, results[1:]))


@pytest.fixture(scope="module")
def plain_tp2(served_tp2):
    return served_tp2[:2]


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_ep_gives_plain_tp2_tokens(served_tp2, learned_ep2, case):
    _, plain, results = served_tp2
    smoe, compiled, says = CASES[case]
    if smoe.get("placement") == "learned":
        smoe = {**smoe, "placement": learned_ep2}
    out, log = results[case]
    if says:  # the token order really ran, around vLLM's own MoE blocks, and tokens moved
        assert f"token order over 2 ranks around 4 MoE blocks (Qwen3MoeSparseMoeBlock), one order per layer, {says}" in log
        assert "of its expert activations locally" in log
        # s-MoE's shuffled reduce-scatter wherever asked for (router: its gate's logits summed first)
        assert ("attention output: vLLM's all-reduce (reduce_scatter: off)" if smoe["reduce_scatter"] == "off" else
                "attention output: reduce-scattered in the token order at 4 MoE layers") in log
        if smoe["predictor"] == "router" and smoe["reduce_scatter"] == "on":
            assert "predictor router (exact before the reduce" in log
    if smoe.get("all2all", "sparse") == "sparse" and "mode" in smoe:
        assert "sparse de-duplicated all2all manager on group ep" in log
    per = _collectives(log)  # counted by smoe's communicator in served steps, 4 MoE layers
    if "mode" not in smoe:  # vLLM's EP at DP = 1: TP's all-reduce twice a layer, the embedding's, the logits'
        assert per == {"tp all_reduce": 9.0, "tp all_gather": 1.0}, per
    elif not compiled and smoe["reduce_scatter"] == "on" and smoe.get("all2all", "sparse") == "sparse":
        # the shuffled reduce-scatter in the all-reduce's place, the block's chunk all-gather (the
        # markov predictor gathers the previous layer's chunk experts too, at layers 1..3; router
        # the gate's partial logits before each reduce; the learned one broadcasts rank 0's
        # assignment once a step)
        want = {"tp reduce_scatter": 4.0, "tp all_gather": 5.0 + 3.0 * (smoe["predictor"] == "tables-markov")
                + 4.0 * (smoe["predictor"] == "router"),
                "tp all_reduce": 1.0, **({"tp broadcast": 1.0} if smoe["predictor"] == "learned" else {})}
        assert {k: v for k, v in per.items() if not k.startswith("ep ")} == want, per
        # the exchange, in the form the EP group's transport takes: over vLLM's shared-memory
        # communicator (where this host's kernel allows it) a static-size gather and a
        # reduce-scatter a layer; over gloo two (sizes in the rows) or three (sizes first)
        # point-to-point all-to-alls a layer
        exchange = {k: v for k, v in per.items() if k.startswith("ep ")}
        shm = "communicator: shared memory" in log
        if shm:
            assert exchange == {"ep all_gather": 4.0, "ep reduce_scatterv": 4.0}, per
        else:
            assert set(exchange) == {"ep all_to_all"} and 8.0 <= exchange["ep all_to_all"] <= 12.0, per
    assert out["tokens"] == plain["tokens"]
    np.testing.assert_allclose(out["logprobs"], plain["logprobs"], rtol=0, atol=ATOL)
    if case in FILTERED:  # each rank read the experts of its slots, copies too; the same placement unfiltered: all
        whole = _expert_reads(results["tables-markov" if case == "tables" else "replicas-router"][1])
        assert set(whole.values()) == {(whole[0][0], 128)}
        per_layer = 16 + 2 * (smoe["placement"] == EP2_R4)  # home experts (+ copies) of a rank in a layer
        assert _expert_reads(log) == {r: (pytest.approx(whole[0][0] * per_layer / 32, abs=0.01), 4 * per_layer)
                                      for r in (0, 1)}
    if smoe.get("placement") == EP2_R4:
        assert "replicas: 36 physical expert slots per layer (4 redundant), rank 1 routes to its own copies" in log
    if says and not compiled and smoe.get("all2all", "sparse") == "sparse":
        from vllm_smoe.tools.bench.common import SPEC_LINE as _SPEC_LINE, rank_numbers as _rank_numbers

        served = _rank_numbers(log.splitlines(), _SPEC_LINE)
        assert set(served["tokens_per_rank"]) == {0, 1}  # every rank reports its own counters
        key = smoe["predictor"] + ("-replicas" if smoe["placement"] == EP2_R4 else "") + \
            ("-allreduce" if smoe["reduce_scatter"] == "off" else "")
        _LOCAL[key], _PAIRS[key] = served["local_share"], served["remote_pairs_per_token"]


def _expert_reads(log: str) -> dict[int, tuple[float, int]]:
    """{rank: (MB of expert weights it read at load, experts)} from the loader's line."""
    found = re.findall(r"smoe: rank (\d+) read ([\d.]+) MB of expert weights \((\d+) of 128 experts", log)
    return {int(r): (float(mb), int(n)) for r, mb, n in found}


def _collectives(log: str) -> dict[str, float]:
    """Rank 0's last collectives line: {"group kind": per served step}."""
    lines = re.findall(r"smoe: collectives \(rank 0\) per served step over \d+ steps: (.*)", log)
    assert lines, "no collectives line"
    return {" ".join(kv.split()[:2]): float(kv.split()[2]) for kv in lines[-1].split(", ")}


_LOCAL: dict[str, float] = {}  # served local share of each predictor above, both ranks
_PAIRS: dict[str, float] = {}  # remote (token, rank) pairs per token and MoE layer, from the sparse all2all


def test_replicas_keep_more_rows_home():
    """Copies used where the token sits: more activations local and fewer rows on the wire than
    the same build without copies. The pairs are counted on the physical ids vLLM's router
    produced, so an unused copy would not lower them."""
    if not {"tables", "tables-replicas", "router", "router-replicas"} <= set(_PAIRS):
        pytest.skip("needs the served runs of test_tp2_ep_gives_plain_tp2_tokens")
    for p in ("tables", "router"):
        assert _LOCAL[p + "-replicas"] > _LOCAL[p] + 0.05, _LOCAL
        assert _PAIRS[p + "-replicas"] < _PAIRS[p] * 0.9, _PAIRS
    assert _LOCAL["router-replicas"] > _LOCAL["tables-replicas"], _LOCAL


def test_router_order_is_more_local_than_every_prediction():
    """The router predictor knows each token's experts, so its order keeps more activations local
    than the trained tables, and a random order keeps the fewest (the learned predictor too keeps
    far more than a random order)."""
    if not {"router", "tables", "tables-markov", "random"} <= set(_LOCAL):
        pytest.skip("needs the served runs of test_tp2_ep_gives_plain_tp2_tokens")
    assert _LOCAL["router"] > max(_LOCAL["tables"], _LOCAL["tables-markov"]) > _LOCAL["random"], _LOCAL
    if "router-allreduce" in _LOCAL:  # exact both ways: the logits summed before the reduce pick vLLM's experts
        assert abs(_LOCAL["router"] - _LOCAL["router-allreduce"]) < 0.005, _LOCAL
    if "learned" in _LOCAL:  # its own placement (built the same way): far above a random order
        assert _LOCAL["learned"] > _LOCAL["random"] + 0.05, _LOCAL
    if "input-gate" in _LOCAL:  # the gate on the layer's input: as far above it
        assert _LOCAL["input-gate"] > _LOCAL["random"] + 0.05, _LOCAL


@pytest.mark.parametrize("smoe,ep,words", [
    ({**SPEC, "placement": os.path.join(REPO, "configs", "tiny-4dom-ep4.yaml")}, True,
     "field 'ep_size' = 4 but experts are split over 2 ranks"),
    (SPEC, False, "needs --enable-expert-parallel"),
    ({"placement": EP2_R4}, True, "every rank routes every row"),  # TP=2 + EP without speculate's split rows
])
def test_speculate_refuses_before_serving(smoe, ep, words):
    """Refused on the engine config `LLM` and `vllm serve` build (in this process: no engine,
    no worker starts)."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    ea = EngineArgs(model=FIXTURE_MODEL, dtype="float32", max_model_len=512, skip_tokenizer_init=True,
                    tensor_parallel_size=2, enable_expert_parallel=ep, additional_config={"smoe": smoe})
    with pytest.raises(ValueError, match=re.escape(words)):
        ea.create_engine_config()


def _served_tokens(port: int, prompt: list[int], max_tokens: int = 8) -> list[int]:
    import urllib.request

    body = json.dumps({"model": FIXTURE_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["choices"][0]["token_ids"]


def _swap(port: int, path: str, method: str = "POST") -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    data = json.dumps({"placement": path}).encode() if method == "POST" else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}/smoe/placement", data,
                                 {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:  # vLLM's API server wraps errors as {"error": {"message": ...}}
        body = json.load(e)
        return e.code, {"detail": body.get("detail") or body["error"]["message"]}


@pytest.mark.parametrize("replicas", [0, 4], ids=["homes", "replicas"])
def test_live_swap_under_load_keeps_plain_tokens(plain_tp2, tmp_path, replicas):
    """vllm serve TP=2 + EP, speculate with tables: placements swapped live (python-only ->
    the mixed build -> back) while clients keep sending the held-out prompts. Every answer equals
    plain TP=2 vLLM's greedy tokens, before, during and after the swaps; bad files are refused
    with the field named and the served placement stays. With copies, the routes move too (each
    rank's copies change), and a placement with another slot count is refused."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from vllm_smoe.tools.place_cli import main as place
    from vllm_smoe.tools.server_process import VllmServer
    from vllm_smoe.formats.trace import read_traces, write_trace

    prompts, plain = plain_tp2
    fields = ("token_ids", "request_ids", "positions", "topk_ids", "step_ids", "is_prefill", "domain")
    meta, tr, _ = read_traces([FIXTURE_TRACES["train"]], fields)
    keep = tr["domain"] == 0
    write_trace(str(tmp_path / "py.npz"), meta, **{k: v[keep] for k, v in tr.items()})
    (tmp_path / "ok").mkdir()
    first = str(tmp_path / "ok" / "python.yaml")
    assert place(["build", "--trace", str(tmp_path / "py.npz"), "--ep-size", "2", "-o", first]
                 + (["--replicas", str(replicas)] if replicas else [])) == 0
    target, other_slots = (EP2_R4, EP2) if replicas else (EP2, EP2_R4)
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_PLUGINS": "smoe"}  # VLLM_PLUGINS: vLLM's gate for new routes
    with VllmServer(FIXTURE_MODEL, "--tensor-parallel-size", "2", "--enable-expert-parallel", "--plugin", "smoe",
                    "--smoe-mode", "speculate", "--smoe-placement", first, "--smoe-log-interval", "0.5",
                    "--smoe-placement-dirs", f"{tmp_path / 'ok'}:{os.path.join(REPO, 'configs')}",
                    log=tmp_path / "s.log", env=env) as s:
        assert _swap(s.port, "", "GET") == (200, {"placement": first, "swaps": 0, "last_swap": None})
        with ThreadPoolExecutor(8) as pool:
            def wave():
                return [pool.submit(_served_tokens, s.port, p) for p in prompts]

            def busy(w):  # a wave's first answers are in: the rest are being generated
                next(as_completed(w))
                next(as_completed(w[8:]))

            waves = [wave()]
            busy(waves[-1])
            status, done = _swap(s.port, target)
            assert status == 200 and done["previous"] == first and done["moved_slots"] > 0, done
            waves.append(wave())
            for bad, words in [(os.path.join(REPO, "configs", "tiny-4dom-ep4.yaml"), "field 'ep_size' = 4"),
                               (other_slots, "field 'layers[].replicas'"),
                               (str(tmp_path / "ok" / "missing.yaml"), "placement file not found"),
                               (shutil.copy(target, tmp_path), "not inside the directories")]:
                status, answer = _swap(s.port, bad)
                assert status == 400 and words in answer["detail"], answer
            assert _swap(s.port, "", "GET")[1]["placement"] == target
            waves.append(wave())
            busy(waves[-1])
            status, back = _swap(s.port, first)
            assert status == 200 and back["previous"] == target, back
            waves.append(wave())
            outs = [[f.result() for f in w] for w in waves]
        assert _swap(s.port, "", "GET")[1]["swaps"] == 2
    for out in outs:
        assert out == plain["tokens"]
    log = (tmp_path / "s.log").read_text()
    assert log.count("smoe: live placement:") == 4  # two swaps, both ranks
    swapped = [i for i, ln in enumerate(log.splitlines()) if "smoe: live placement:" in ln]
    served = [i for i, ln in enumerate(log.splitlines()) if "/v1/completions HTTP/1.1\" 200" in ln]
    assert served[0] < swapped[0] < served[-1] and served[0] < swapped[-1] < served[-1]  # answers on both sides


def test_live_swap_in_vllms_default_compiled_mode(tmp_path):
    """vllm serve compiled (no --enforce-eager), TP=2 + EP: vLLM's CPU build packs each router's
    weight into a tensor the compiled model holds; a live swap refills it in place, so the
    server's greedy tokens are the same before, after a swap to another placement, and after
    the swap back (a stale router would score rows of the old order against moved experts)."""
    import yaml

    from vllm_smoe.tools.server_process import CPU_ARGS, VllmServer

    doc = yaml.safe_load(open(EP2))
    for layer in doc["layers"]:
        layer["expert_to_rank"] = [1 - r for r in layer["expert_to_rank"]]  # every expert to the other rank
    for key in ("predictor", "predictor_sha256", "metrics"):
        doc.pop(key, None)
    other = tmp_path / "swapped.yaml"
    other.write_text(yaml.safe_dump(doc))
    prompts = _prompts(8)
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_PLUGINS": "smoe"}
    compiled = tuple(a for a in CPU_ARGS if a != "--enforce-eager")
    with VllmServer(FIXTURE_MODEL, "--tensor-parallel-size", "2", "--enable-expert-parallel", "--plugin", "smoe",
                    "--smoe-placement", EP2, "--smoe-placement-dirs", f"{os.path.dirname(EP2)}:{tmp_path}",
                    base_args=compiled, log=tmp_path / "s.log", env=env) as s:
        before = [_served_tokens(s.port, p) for p in prompts]
        status, done = _swap(s.port, str(other))
        assert status == 200 and done["moved_slots"] == 128, done
        after = [_served_tokens(s.port, p) for p in prompts]
        status, back = _swap(s.port, EP2)
        assert status == 200 and back["moved_slots"] == 128, back
        again = [_served_tokens(s.port, p) for p in prompts]
    assert after == before and again == before


def test_auto_replace_swaps_by_itself_when_the_workload_shifts(plain_tp2, tmp_path):
    """vllm serve TP=2 + EP in speculate with --smoe-auto-replace, serving a placement built on one
    domain (python) of the training trace while the clients send held-out prompts of every domain:
    drift holds, the controller builds a candidate from the recording off the serving path, judges
    it on the recording's held-out half and swaps it in by itself, with no operator. No request
    fails, every answer equals plain TP=2 vLLM's greedy tokens, before and after the swap, and
    /metrics counts what the log says."""
    import time
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from vllm_smoe.formats.trace import read_traces, write_trace
    from vllm_smoe.tools.place import main as place
    from vllm_smoe.tools.server_process import VllmServer

    prompts, plain = plain_tp2
    fields = ("token_ids", "request_ids", "positions", "topk_ids", "step_ids", "is_prefill", "domain")
    meta, tr, _ = read_traces([FIXTURE_TRACES["train"]], fields)
    keep = tr["domain"] == 0
    write_trace(str(tmp_path / "py.npz"), meta, **{k: v[keep] for k, v in tr.items()})
    served = str(tmp_path / "python.yaml")
    assert place(["build", "--trace", str(tmp_path / "py.npz"), "--ep-size", "2", "-o", served]) == 0
    auto = {"hold_s": 0, "cooldown_s": 5, "max_moves": 0.5, "margin": 0.0, "window_tokens": 1 << 16,
            "min_tokens": 4096, "build_timeout_s": 300}
    extra = {"smoe": {"record_chunk_tokens": 512, "drift_threshold": 0.95, "auto_replace": auto}}
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_PLUGINS": "smoe"}
    outs, after = [], None
    with VllmServer(FIXTURE_MODEL, "--tensor-parallel-size", "2", "--enable-expert-parallel", "--plugin", "smoe",
                    "--smoe-mode", "speculate", "--smoe-placement", served, "--smoe-log-interval", "1",
                    "--smoe-record", str(tmp_path / "rec"), "--smoe-auto-replace", "on",
                    "--additional-config", json.dumps(extra), log=tmp_path / "s.log", env=env) as s:
        deadline = time.monotonic() + 900
        with ThreadPoolExecutor(8) as pool:
            while time.monotonic() < deadline:
                outs.append([f.result() for f in [pool.submit(_served_tokens, s.port, p) for p in prompts]])
                swaps = _swap(s.port, "", "GET")[1]["swaps"]
                if swaps and after is None:
                    after = len(outs)  # the waves from here on were sent after the swap
                elif after is not None and len(outs) > after:
                    break
        with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/metrics", timeout=60) as r:
            metrics = r.read().decode()
    log = (tmp_path / "s.log").read_text()
    assert after is not None, "no automatic swap: " + "; ".join(
        ln for ln in log.splitlines() if "auto-replace" in ln or "drift" in ln)[-2000:]
    for out in outs:
        assert out == plain["tokens"]
    decisions = [ln for ln in log.splitlines() if "smoe: auto-replace: decision=" in ln]
    assert any("decision=swapped" in ln for ln in decisions), decisions
    swapped = sum("decision=swapped" in ln for ln in decisions)
    assert f"smoe:auto_swaps_total {float(swapped)}" in metrics
    assert "smoe: live placement:" in log  # through the live-swap path, on the workers
