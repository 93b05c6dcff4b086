"""Real `vllm serve ... --plugin smoe` servers (vLLM CPU build, fp32, the trained fixture)."""

import os
import subprocess
import time

import numpy as np
import pytest
import yaml

from vllm_smoe.tools.server_process import CPU_ARGS, VllmServer, free_port, vllm_executable
from vllm_smoe.testbed import FIXTURE_MODEL
from vllm_smoe.formats.trace import read_traces
from tests.support import REPO, derangement_yaml, heldout_prompts, plain_prompts, serve_engine_config

pytest.importorskip("vllm")
pytest.importorskip("openai")

VLLM = vllm_executable()
BASE = list(CPU_ARGS)


@plain_prompts
def _prompts(n=6):
    return heldout_prompts(n, lambda i, r: 7 + 3 * (r % 5))


def _derangement(path):
    return derangement_yaml(path, shift=1)


def test_serve_with_placement_matches_plain_vllm(tmp_path, plain_served):
    prompts = _prompts()
    want = plain_served(prompts)
    assert "smoe: placement applied" not in open(plain_served.log).read()  # --plugin absent: inactive
    rec = tmp_path / "rec"  # recording on the same server: placement + record mode
    placed = VllmServer(FIXTURE_MODEL, "--plugin", "smoe", "--smoe-placement", _derangement(tmp_path / "p.yaml"), "--smoe-mode",
                    "record", "--smoe-record", str(rec), log=tmp_path / "smoe.log").wait()
    try:
        got = placed.complete(prompts)
        time.sleep(4)  # the recorder closes its chunk after 2 s without steps
    finally:
        placed.stop()
    log = (tmp_path / "smoe.log").read_text()
    assert "smoe: placement applied: 384 expert tensors renamed, 4 router/fused tensors reordered, " \
           "128 of 128 expert slots changed" in log
    assert [g[0] for g in got] == [w[0] for w in want]  # identical greedy completions
    np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], rtol=0, atol=1e-4)  # fp32 logprobs
    # the server's recording holds every processed token once (8 generated, the last never processed)
    _, arr, _ = read_traces([str(rec)])
    assert arr["token_ids"].size == sum(len(p) for p in prompts) + len(prompts) * 7
    assert arr["is_prefill"].sum() == sum(len(p) for p in prompts)


def _bad_yaml(tmp_path, kind):
    p = tmp_path / "bad.yaml"
    doc = yaml.safe_load(open(_derangement(tmp_path / "good.yaml")))
    if kind == "missing":
        return str(tmp_path / "nope.yaml"), "not found"
    if kind == "malformed":
        p.write_text("smoe_placement: [1\n")
        return str(p), "malformed YAML"
    if kind == "version":
        doc["smoe_placement"] = 7
        want = "'smoe_placement'"
    elif kind == "experts":
        doc["model"]["num_experts"] = 16
        doc["ep_size"] = 16
        doc["layers"] = [{"expert_to_rank": list(range(16))} for _ in range(4)]
        want = "model.num_experts"
    elif kind == "twice":
        doc["ep_size"] = 4
        doc["layers"] = [{"expert_to_rank": [e // 8 for e in range(32)]} for _ in range(4)]
        doc["layers"][2]["expert_to_rank"] = [0] * 9 + [1] * 7 + [2] * 8 + [3] * 8  # expert 8 on rank 0, not 1
        want = "layers[2].expert_to_rank"
    elif kind == "rank":
        doc["layers"][1]["expert_to_rank"][5] = 32
        want = "ep_size=32"
    elif kind == "fingerprint":
        doc["model"]["fingerprint"] = "feedfacefeedface"
        want = "model.fingerprint"
    p.write_text(yaml.safe_dump(doc))
    return str(p), want


KINDS = ["missing", "malformed", "version", "experts", "twice", "rank", "fingerprint"]


def test_bad_placement_is_refused_by_the_engine_config(tmp_path):
    """Every kind of bad file, through the hook `vllm serve` runs on vLLM's engine config (one
    process for all of them): a ValueError naming the file and the field, before any engine."""
    from vllm.engine.arg_utils import EngineArgs

    for kind in KINDS:
        (tmp_path / kind).mkdir()
        path, words = _bad_yaml(tmp_path / kind, kind)
        ea = EngineArgs(model=FIXTURE_MODEL, dtype="float32", max_model_len=512, skip_tokenizer_init=True,
                        additional_config={"smoe": {"placement": path}})
        with pytest.raises(ValueError) as e:
            ea.create_engine_config()
        assert path in str(e.value) and words in str(e.value), (kind, str(e.value))


# the command line's own exit (one line, code 2) for a refused file (every kind is refused by the
# same hook, above; each start of vLLM's CLI costs ~15 s)
def test_bad_placement_never_starts_serving(tmp_path):
    path, words = _bad_yaml(tmp_path, "twice")
    r = subprocess.run([VLLM, "serve", FIXTURE_MODEL, "--port", str(free_port()), *BASE, "--plugin", "smoe",
                        "--smoe-placement", path], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert path in out and words in out, out[-3000:]
    assert "Starting vLLM server" not in out and "Application startup complete" not in out


def test_unwritable_record_directory_is_refused(tmp_path):
    from vllm_smoe.serving.config import SmoeSettingsError

    locked = tmp_path / "locked"
    locked.write_text("a file, not a directory")
    with pytest.raises(SmoeSettingsError, match="field 'record'") as e:
        serve_engine_config("--plugin", "smoe", "--smoe-record", str(locked / "traces"))
    assert str(locked) in str(e.value)


def test_smoe_flags_need_the_plugin_flag():
    with pytest.raises(ValueError, match="--smoe-placement given without --plugin smoe"):
        serve_engine_config("--smoe-placement", "x.yaml")


def test_speculate_with_a_mixed_placement_pair_never_starts_an_engine(tmp_path):
    """Tables of another build under the name the YAML expects: refused by the pre-serve check,
    before any engine or worker starts (no weights loaded, nothing to leak)."""
    import shutil

    from vllm_smoe.formats.placement_file import load_placement

    ep2 = os.path.join(REPO, "configs", "tiny-4dom-ep2.yaml")
    ep4 = os.path.join(REPO, "configs", "tiny-4dom-ep4.yaml")
    shutil.copy(ep2, tmp_path / "p.yaml")
    mine = tmp_path / os.path.basename(load_placement(ep2).predictor)
    shutil.copy(load_placement(ep4).predictor, mine)
    r = subprocess.run([VLLM, "serve", FIXTURE_MODEL, "--port", str(free_port()), *BASE, "--plugin", "smoe",
                        "--tensor-parallel-size", "2", "--enable-expert-parallel", "--smoe-mode", "speculate",
                        "--smoe-placement", str(tmp_path / "p.yaml")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "predictor_sha256" in out and str(mine) in out, out[-3000:]
    assert "EngineCore" not in out and "Starting to load model" not in out
