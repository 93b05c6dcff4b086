"""Bad input, as a careless or unlucky user gives it: every case exits 2 (or is refused) with
the file and the field or flag named, no traceback, and leaves nothing behind."""

import os
import subprocess
import sys

import pytest
from tests.unit.test_hardening import _expect


@pytest.mark.parametrize("args,words", [
    (["--smoe-log-interval", "-1"], "field 'log_interval' must be a positive number"),
    (["--smoe-record", ""], "field 'record' must be a path"),
    (["--additional-config", '{"smoe": 5}'], "field 'smoe' must be a mapping"),
    (["--smoe-record", "/proc/smoe-rec"], "field 'record': cannot write in /proc/smoe-rec"),
])
def test_vllm_serve_refuses_smoe_settings_in_one_line_with_exit_2(args, words):
    pytest.importorskip("vllm")
    from vllm_smoe.testbed import FIXTURE_MODEL

    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    r = subprocess.run([vllm, "serve", str(FIXTURE_MODEL), "--plugin", "smoe", *args], capture_output=True,
                       text=True, timeout=300)
    _expect(r, words)
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == \
        [ln for ln in r.stderr.splitlines() if "error:" in ln.lower()]  # one error line, nothing else
