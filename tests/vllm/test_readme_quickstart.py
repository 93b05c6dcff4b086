"""README.md's quickstart runs as written: the fenced shell block after ``<!-- quickstart -->``
is extracted and run with bash in an empty directory, on the embedded fixture model (two vLLM
starts, eager, fp32). Only the port is changed, to a free one, so that a server left on vLLM's
default port cannot answer for it."""

import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.support import REPO

MARK = "<!-- quickstart -->"


def quickstart_block(text: str) -> str:
    """The first ```bash fenced block after the quickstart mark."""
    rest = text[text.index(MARK) + len(MARK):]
    m = re.search(r"```bash\n(.*?)```", rest, re.S)
    assert m, "no ```bash block after " + MARK
    return m.group(1)


def test_the_quickstart_block_is_marked_and_serves_on_the_default_port():
    block = quickstart_block(open(os.path.join(REPO, "README.md")).read())
    assert "vllm serve" in block and "smoe-place build" in block and "--port 8000" in block


def test_the_readme_quickstart_runs_as_written(tmp_path):
    pytest.importorskip("vllm")
    from vllm_smoe.formats.trace import read_traces
    from vllm_smoe.tools.server_process import free_port

    block = quickstart_block(open(os.path.join(REPO, "README.md")).read())
    script = tmp_path / "quickstart.sh"
    script.write_text("set -euo pipefail\n" + block.replace("8000", str(free_port())))
    bindir = os.path.dirname(sys.executable)  # vllm, smoe-testbed and smoe-place of this environment
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    log = tmp_path / "quickstart.log"
    with open(log, "w") as out:
        try:
            rc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=900, start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = log.read_text()
    assert rc == 0, f"quickstart exited {rc}; log tail:\n{text[-4000:]}"
    # step 1 recorded every processed token, step 2 placed from it, step 3 served with the placement
    _, arr, _ = read_traces([str(tmp_path / "traces")])
    assert arr["token_ids"].size > 0
    doc = yaml.safe_load((tmp_path / "my-ep4.yaml").read_text())
    assert doc["ep_size"] == 4 and len(doc["layers"]) == 4
    assert "smoe: placement applied" in text
    assert text.count('"object":"text_completion"') == 8  # 4 prompts answered by each server
