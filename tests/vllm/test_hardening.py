"""Bad input, as a careless or unlucky user gives it: every case exits 2 (or is refused) with
the file and the field or flag named, no traceback, and leaves nothing behind."""

import os
import subprocess
import sys

import pytest
from tests.support import built, serve_engine_config
from tests.unit.test_hardening import _expect

# vllm serve's flags as a user types them, and the refusal each gets
CASES = [
    (["--smoe-log-interval", "-1"], "field 'log_interval' must be a positive number"),
    (["--smoe-record", ""], "field 'record' must be a path"),
    (["--additional-config", '{"smoe": 5}'], "field 'smoe' must be a mapping"),
    (["--smoe-record", "/proc/smoe-rec"], "field 'record': cannot write in /proc/smoe-rec"),
]


def test_vllm_serve_refuses_smoe_settings_in_one_line_with_exit_2():
    """The command line's own exit for a refused setting: code 2, one error line (every case
    below takes the same path out; each starts vLLM's CLI for ~15 s, so one does here)."""
    pytest.importorskip("vllm")
    from vllm_smoe.testbed import FIXTURE_MODEL

    args, words = CASES[-1]
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    r = subprocess.run([vllm, "serve", str(FIXTURE_MODEL), "--plugin", "smoe", *args], capture_output=True,
                       text=True, timeout=300)
    _expect(r, words)
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == \
        [ln for ln in r.stderr.splitlines() if "error:" in ln.lower()]  # one error line, nothing else


@pytest.mark.parametrize("args,words", CASES)
def test_serve_flags_are_refused_by_name_before_any_engine(args, words):
    """vllm serve's own steps in this process: its engine flags parsed, folded into the engine
    args and checked while the engine config is built: smoe's settings error naming the field."""
    pytest.importorskip("vllm")
    from vllm_smoe.serving.config import SmoeSettingsError

    with pytest.raises(SmoeSettingsError, match=words):
        serve_engine_config("--plugin", "smoe", *args)


def test_dp_placement_with_tp_needs_one_node_per_engine():
    """DP=2 engines of TP=2: a --mode dp placement over 4 ranks is served only when its requests
    were put on engines first (--nodes 2); a flat one is refused, naming the build that fits."""
    pytest.importorskip("vllm")
    from vllm_smoe.serving.config import SmoeSettingsError
    from vllm_smoe.testbed import FIXTURE_TRACES

    flags = ("--plugin", "smoe", "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--enable-expert-parallel")
    n1, n2 = (built("place_cli", "build", "--trace", FIXTURE_TRACES["train"], "--ep-size", 4, "--mode", "dp",
                    "--nodes", nodes) for nodes in (1, 2))
    with pytest.raises(SmoeSettingsError, match=r"field 'nodes' = 1: .* --mode dp --ep-size 4 --nodes 2"):
        serve_engine_config(*flags, "--smoe-placement", n1)
    assert serve_engine_config(*flags, "--smoe-placement", n2) is not None
