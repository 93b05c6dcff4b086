"""What the tests share: the repository's paths, held-out prompts of the trained fixture and
placement files that move every expert. Import it as ``from tests.support import ...``."""

import os

import numpy as np
import yaml

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
CONFIGS = os.path.join(REPO, "configs")
# vLLM's offline engine in a child process: argv model, prompts (JSON), max_tokens[, extra config (JSON)]
HELPER = os.path.join(TESTS, "helpers", "vllm_generate.py")


# Functions giving the prompt lists (token ids) that served tests compare with a plain ``vllm
# serve`` of the trained fixture, registered when their module is imported: one server answers
# them all (tests/vllm/conftest.py, ``plain_served``).
PLAIN_PROMPTS: list = []


def plain_prompts(make):
    """Registers ``make`` (no arguments -> a list of prompts) with PLAIN_PROMPTS; returns it."""
    PLAIN_PROMPTS.append(make)
    return make


def gloo_all_gather(x, dim=0):
    """[W * n, ...] every rank's x in rank order, on the default (gloo) group; dim must be 0 (the
    signature of vLLM's group all_gather, which smoe's ops call)."""
    import torch.distributed as dist

    assert dim == 0
    out = x.new_empty((dist.get_world_size() * x.shape[0],) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous())
    return out


def gloo_reduce_scatter(x):
    """[W * c, ...] -> [c, ...] summed over the default (gloo) group, rank r's c rows."""
    import torch.distributed as dist

    out = x.new_empty((x.shape[0] // dist.get_world_size(),) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous())
    return out


def heldout_prompts(n, length=lambda i, r: 3 + i, trace=None, skip=None):
    """The first ``length(i, r)`` tokens of n held-out requests (the i-th chosen, request id r) of
    ``trace`` (default: the Qwen3 fixture's held-out split): requests spread evenly over the trace,
    or with ``skip``, the n requests after the first ``skip``."""
    from vllm_smoe.formats.trace import open_trace
    from vllm_smoe.testbed import FIXTURE_TRACES

    t = open_trace(trace or FIXTURE_TRACES["heldout"])
    tok, req = t["token_ids"], t["request_ids"]
    reqs = np.unique(req)
    reqs = reqs[skip: skip + n] if skip is not None else reqs[:: max(1, len(reqs) // n)][:n]
    return [tok[req == r][: length(i, r)].tolist() for i, r in enumerate(reqs)]


def transformers_greedy(model, prompt, n):
    """The n tokens transformers' ``model`` generates greedily after ``prompt`` (ids), full
    forward passes without a cache: the reference vLLM's greedy tokens are checked against."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def derangement_yaml(path, shift=1, ep=32, layers=4, experts=32, step=1, **model):
    """A placement file moving expert e of layer i to slot (e + shift + step * i) % experts,
    ``experts // ep`` slots a rank; ``model`` adds fields to its model section. Returns str(path)."""
    doc = {"smoe_placement": 1, "model": {"num_layers": layers, "num_experts": experts, "top_k": 4, **model},
           "ep_size": ep, "layers": [{"expert_to_rank": [((e + shift + step * i) % experts) * ep // experts
                                                         for e in range(experts)]} for i in range(layers)]}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


# (module, *args) -> the output path of that build, made once per test run (see ``built``)
_BUILT: dict[tuple[str, ...], str] = {}
_BUILD_DIR: list[str] = []  # the run's build directory, made at the first build


def built(module, *args):
    """The output of ``python -m vllm_smoe.tools.<module> *args -o PATH``, built once per test
    run for each exact argument list and shared by every test that asks for it (smoe-place and
    smoe-testbed are deterministic: seeded, one output per input). The output lies in a
    directory of the whole run, removed at exit: read it, never change it. Fails the test with
    the command's stderr when it exits non-zero."""
    import atexit
    import shutil
    import subprocess
    import sys
    import tempfile

    key = (module, *map(str, args))
    if key not in _BUILT:
        if not _BUILD_DIR:
            _BUILD_DIR.append(tempfile.mkdtemp(prefix="smoe-test-builds-"))
            atexit.register(shutil.rmtree, _BUILD_DIR[0], True)
        out = os.path.join(_BUILD_DIR[0], f"{len(_BUILT)}-{module}-{args[0]}")
        if module == "place_cli":
            out += ".yaml"
        elif module == "testbed_cli" and args[0] == "record":
            out += ".npz"
        r = subprocess.run([sys.executable, "-m", f"vllm_smoe.tools.{module}", *key[1:], "-o", out],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{' '.join(key)}:\n{r.stderr[-3000:]}"
        _BUILT[key] = out
    return _BUILT[key]


def random_model(arch, experts, top_k, layers=2):
    """``smoe-testbed build`` of a random ``arch`` checkpoint (the fixture's tokenizer), once per run."""
    return built("testbed_cli", "build", "--arch", arch, "--experts", experts, "--top-k", top_k, "--layers", layers)


def random_model_placed(tmp_dir, arch, experts, top_k, layers=2, ep=2):
    """The README's way, offline: ``smoe-testbed build`` a random checkpoint of ``arch``, record
    its routing (transformers), ``smoe-place build --ep-size ep``; each step once per test run
    for the same arguments (``built``; tmp_dir is not used). Returns (model dir, placement)."""
    model = random_model(arch, experts, top_k, layers)
    trace = built("testbed_cli", "record", "--model", model, "--requests", 8, "--seq-len", 64)
    return model, built("place_cli", "build", "--trace", trace, "--ep-size", ep, "--model", model)


def vllm_runs(runs, tmp_dir, tp=1, timeout=1800):
    """Greedy generations of several engines in one child process (vLLM imported once; each
    engine and its workers stopped before the next). runs: dicts with "model", "prompts",
    "max_tokens" and optionally "extra" (vLLM's additional_config), "ep", "compiled" (bools), "dtype"
    (default float32), "engine" (more arguments of vLLM's LLM).
    Returns [(result {"tokens", "logprobs"}, that run's log)], one per run, in order. Fails the
    test with the first traceback in the output when the process does not finish them all."""
    import json
    import re
    import subprocess
    import sys

    import pytest

    path = os.path.join(str(tmp_dir), "runs.json")
    with open(path, "w") as f:
        json.dump(runs, f)
    env = {**os.environ, "SMOE_TEST_TP": str(tp), "VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else "0"}
    r = subprocess.run([sys.executable, HELPER, "--runs", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=timeout, env=env)
    out = []
    for i in range(len(runs)):
        m = re.search(rf"^SMOE_RUN_BEGIN {i}\n(.*?)^SMOE_RUN_END {i}$", r.stdout, re.S | re.M)
        result = f"{path}.result{i}.json"  # written by the helper at the run's end (the log may interleave)
        if m and os.path.isfile(result):
            with open(result) as f:
                out.append((json.load(f), m.group(1)))
            continue
        line = [ln for ln in m.group(1).splitlines() if ln.startswith("SMOE_RESULT ")] if m else []
        if not line:  # the root cause sits above the engine's last words
            log = r.stdout.splitlines()
            first = next((k for k, ln in enumerate(log) if "Traceback" in ln  # not vLLM's warm-up's
                          and "skip_tokenizer_init" not in "".join(log[k:k + 20])), max(0, len(log) - 40))
            pytest.fail(f"run {i} of {len(runs)} ({runs[i].get('extra')}) gave no result; vLLM exited with "
                        f"{r.returncode}:\n" + "\n".join(log[first: first + 60]) + "\n...\n" + "\n".join(log[-20:]))
        out.append((json.loads(line[0][len("SMOE_RESULT "):]), m.group(1)))
    return out


def serve_engine_config(*flags):
    """What ``vllm serve MODEL *flags`` does before it starts an engine, in this process: vLLM's
    plugins loaded (smoe's flags and hooks), the engine flags parsed, folded into EngineArgs and
    the engine config built (smoe's checks run there). Returns the VllmConfig or raises."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_smoe.testbed import FIXTURE_MODEL

    load_general_plugins()
    ns = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", str(FIXTURE_MODEL), *flags])
    return EngineArgs.from_cli_args(ns).create_engine_config()
