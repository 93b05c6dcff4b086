"""Hostile inputs and bad moments for a live swap (``POST /smoe/placement``), one test per probe
finding: a signal while a move is stuck, a FIFO swapped in after the check, a NUL byte, a huge
YAML, /health during an overdue move, a broken ``--additional-config``, ``--smoe-placement-dirs``
that drops the served directory or names nothing. The routes run on FastAPI's TestClient (or
httpx on one loop) against a stand-in engine, set up by the endpoint plugin's own ``init_state``."""

import asyncio
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm_smoe.serving.place.swap import EXTENSION  # noqa: E402


def _placement(path, expert2rank=(0, 1, 0, 1)):
    from vllm_smoe.formats.placement_file import write_placement

    write_placement(str(path), expert2rank=np.asarray([expert2rank], dtype=np.int32), ep_size=2, nodes=1, top_k=2,
                    vocab_size=8, method="test", capacity=1.1, tables=None)
    return str(path)


class _Engine:
    """A stand-in for vLLM's engine client: two workers; apply can hang (a stopped worker) and
    ``errored`` turns true once vLLM's shutdown has stopped the engine."""

    def __init__(self):
        self.calls, self.hang, self.errored = [], False, False
        self.applying = asyncio.Event()

    async def collective_rpc(self, method, timeout=None, args=()):
        self.calls.append(method)
        if method == "smoe_prepare_placement":
            return [{"reason": "", "bytes": 1000}, {"reason": "", "bytes": 0}]
        if method == "smoe_apply_placement":
            self.applying.set()
            if self.hang:
                await asyncio.Event().wait()  # never answers: the engine core waits on a stopped worker
            return [{"moved_slots": 2, "seconds": 0.01}, {"moved_slots": 2, "seconds": 0.01}]
        return [None, None]

    async def check_health(self):
        pass


def _app(tmp_path, monkeypatch, engine=None, health=False):
    """vLLM's app as an endpoint plugin sees it: (vLLM's /health,) smoe's routes, smoe's state from
    its own init_state for a server whose placement is ``tmp_path/served/a.yaml``."""
    from fastapi import FastAPI
    from vllm.plugins.endpoint_plugins import interface

    from vllm_smoe.serving import endpoints
    from vllm_smoe.serving.place import check

    monkeypatch.setattr(check, "check_served_placement", lambda path, cfg, vc, snapshot=None: None)
    served = tmp_path / "served"
    served.mkdir(exist_ok=True)
    a = _placement(served / "a.yaml")
    app = FastAPI()
    if health:
        from vllm.entrypoints.serve.instrumentator.health import router

        app.include_router(router)
    plugin = endpoints.SmoeEndpoints()
    monkeypatch.setattr("vllm.plugins.load_endpoint_plugins", lambda tasks: [plugin])
    interface.attach_endpoint_plugins(app, ("generate",))
    engine = engine or _Engine()
    pc = SimpleNamespace(data_parallel_size=1, pipeline_parallel_size=1, enable_eplb=False, _api_process_count=1,
                         worker_extension_cls=EXTENSION, tensor_parallel_size=1, enable_expert_parallel=True)
    engine.vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=64, skip_tokenizer_init=True), parallel_config=pc,
        additional_config={"smoe": {"placement": a, "metrics": False}})
    app.state.engine_client = engine
    asyncio.run(plugin.init_state(engine, app.state, SimpleNamespace(api_key=None)))
    return app, engine, served


async def _post(app, path, within: float):
    """POST /smoe/placement on this loop; the answer, or TimeoutError after ``within`` seconds."""
    import httpx

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://smoe") as c:
        return await asyncio.wait_for(c.post("/smoe/placement", json={"placement": path}), within)


def test_a_stop_while_a_move_hangs_answers_the_swap_within_seconds(tmp_path, monkeypatch):
    """Probe 1: SIGTERM while apply waits on a stopped worker. vLLM's shutdown stops the engine
    client first (its engine core killed, ``errored`` true), then waits for open requests: the
    swap must answer then (503, the server stopping), not wait for an engine that is gone."""
    engine = _Engine()
    engine.hang = True
    app, engine, served = _app(tmp_path, monkeypatch, engine)
    new = _placement(served / "b.yaml", (1, 0, 1, 0))

    async def scenario():
        swap = asyncio.ensure_future(_post(app, new, within=10))
        await asyncio.wait_for(engine.applying.wait(), 5)
        t0 = time.monotonic()
        engine.errored = True  # vLLM's signal handler has shut the engine client down
        r = await swap
        return r, time.monotonic() - t0

    r, waited = asyncio.run(scenario())
    assert r.status_code == 503 and "stopping" in r.json()["detail"] and waited < 3


def _release(fifo: str) -> None:
    """Unblock a reader stuck opening ``fifo`` (open its write end, then close it: EOF)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # nobody is reading it


def test_a_fifo_swapped_in_after_the_check_is_refused_and_holds_nothing(tmp_path, monkeypatch):
    """Probe 2: a FIFO renamed into an allowed directory between the check and the open. The read
    refuses it after opening (without blocking), and the next swap goes through."""
    from vllm_smoe.formats import bounded

    app, engine, served = _app(tmp_path, monkeypatch)
    fifo = str(served / "fifo.yaml")
    os.mkfifo(fifo)
    real = bounded.regular_file
    # the check ran while a regular file stood there; the FIFO arrives before the open
    monkeypatch.setattr(bounded, "regular_file", lambda path, what, max_bytes=None:
                        0 if path == fifo else real(path, what, max_bytes))
    safety = threading.Timer(6, _release, (fifo,))  # a reader stuck in open() would hold asyncio.run's exit
    safety.start()
    try:
        r = asyncio.run(_post(app, fifo, within=5))
    finally:
        safety.cancel()
    assert r.status_code == 400 and fifo in r.json()["detail"] and "FIFO" in r.json()["detail"]
    r = asyncio.run(_post(app, _placement(served / "b.yaml", (1, 0, 1, 0)), within=5))
    assert r.status_code == 200, r.text


def test_read_bytes_never_blocks_on_a_fifo(tmp_path, monkeypatch):
    from vllm_smoe.formats import bounded

    fifo = str(tmp_path / "f")
    os.mkfifo(fifo)
    monkeypatch.setattr(bounded, "regular_file", lambda path, what, max_bytes=None: 0)
    out = []

    def read():
        try:
            bounded.read_bytes(fifo, "placement file", 100)
        except ValueError as e:
            out.append(str(e))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(3)
    if t.is_alive():
        _release(fifo)
        t.join(3)
        pytest.fail("read_bytes blocked opening a FIFO")
    assert out and "FIFO" in out[0] and fifo in out[0]


def test_a_nul_byte_in_a_yaml_is_a_400_naming_the_file(tmp_path, monkeypatch):
    """Probe 3: a NUL byte (any character YAML does not allow) is the user's error: 400 naming
    the file, as for any malformed YAML."""
    from fastapi.testclient import TestClient

    from vllm_smoe.formats.bounded import load_yaml

    app, engine, served = _app(tmp_path, monkeypatch)
    nul = served / "nul.yaml"
    nul.write_bytes(b"smoe_placement: 1\nmethod: a\x00b\n")
    with pytest.raises(ValueError, match="nul.yaml: placement file: .*character"):
        load_yaml(str(nul), "placement file")
    with TestClient(app) as c:
        r = c.post("/smoe/placement", json={"placement": str(nul)})
    assert r.status_code == 400 and str(nul) in r.json()["detail"] and engine.calls == []


def test_a_huge_yaml_is_refused_at_once_by_what_the_model_holds(tmp_path, monkeypatch):
    """Probe 4: a YAML far larger than any placement of the served model (here 1 layer x 4
    experts) is refused from its size before it is parsed, and the swap lock is free meanwhile."""
    from vllm_smoe.formats.bounded import MAX_YAML_BYTES

    app, engine, served = _app(tmp_path, monkeypatch)
    big = served / "big.yaml"
    text = open(served / "a.yaml").read()
    pad = "built_from: {traces: [" + "0, " * 700_000 + "0]}\n"  # 2.1 MB, under the 16 MiB cap
    big.write_text(text.replace("built_from: {}\n", "") + pad)
    assert 2 << 20 < big.stat().st_size < MAX_YAML_BYTES
    t0 = time.monotonic()
    r = asyncio.run(_post(app, str(big), within=10))
    assert r.status_code == 400 and str(big) in r.json()["detail"] and "1 layers x 4 experts" in r.json()["detail"]
    assert time.monotonic() - t0 < 2 and engine.calls == []


def test_a_placement_is_read_and_checked_outside_the_swap_lock(tmp_path, monkeypatch):
    """Probe 4, the lock: a slow read or check of one file never delays another swap's answer."""
    from vllm_smoe.serving.place import check

    app, engine, served = _app(tmp_path, monkeypatch)
    slow, fast = _placement(served / "slow.yaml"), _placement(served / "fast.yaml", (1, 0, 1, 0))
    gate = threading.Event()

    def check_fn(path, cfg, vc, snapshot=None):
        if path == slow:
            gate.wait(10)
            raise ValueError(f"{path}: refused")

    monkeypatch.setattr(check, "check_served_placement", check_fn)

    async def scenario():
        first = asyncio.ensure_future(_post(app, slow, within=15))
        await asyncio.sleep(0.3)
        try:
            return await _post(app, fast, within=5)
        finally:
            gate.set()
            await first

    assert asyncio.run(scenario()).status_code == 200


def test_health_is_503_once_a_move_passes_its_deadline(tmp_path, monkeypatch):
    """Probe 5: while a move runs past its deadline (the server is about to stop), vLLM's /health
    (replaced through the endpoint plugin's route override) answers 503; before, 200."""
    import httpx

    from vllm_smoe.serving.place import swap

    engine = _Engine()
    engine.hang = True
    app, engine, served = _app(tmp_path, monkeypatch, engine, health=True)
    monkeypatch.setattr(swap, "apply_deadline", lambda moved_bytes: 0.5)
    new = _placement(served / "b.yaml", (1, 0, 1, 0))

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://smoe") as c:
            assert (await c.get("/health")).status_code == 200
            post = asyncio.ensure_future(c.post("/smoe/placement", json={"placement": new}))
            await asyncio.wait_for(engine.applying.wait(), 5)
            during = (await c.get("/health")).status_code
            await asyncio.sleep(0.8)
            overdue = (await c.get("/health")).status_code
            engine.errored = True  # end the stuck move
            await asyncio.wait({post}, timeout=5)
            return during, overdue

    stopped = []
    monkeypatch.setattr(swap, "_stop_server", lambda: stopped.append(1))
    assert asyncio.run(scenario()) == (200, 503)


def test_a_broken_additional_config_is_one_line_naming_the_flag():
    """Probe 6: ``--additional-config '{"smoe": {'`` (not JSON): a settings error naming the flag
    (``vllm serve`` prints it as one line and exits 2), not an AttributeError traceback."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_smoe.serving.config import SmoeSettingsError
    from vllm_smoe.serving.patches import cli

    load_general_plugins()
    ns = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--model", "m", "--plugin", "smoe", "--additional-config", '{"smoe": {'])
    with pytest.raises(SmoeSettingsError, match="--additional-config.*not valid JSON") as e:
        EngineArgs.from_cli_args(ns)
    assert "\n" not in str(e.value)

    def failing(args):
        raise e.value

    cli._serve_cmd._smoe_original = failing
    try:
        with pytest.raises(SystemExit) as exit_:
            cli._serve_cmd(ns)
    finally:
        del cli._serve_cmd._smoe_original
    assert exit_.value.code == 2


def test_placement_dirs_add_to_the_served_directory_and_must_exist(tmp_path):
    """Probe 7: the flag adds directories (the served placement's own stays allowed), and a
    directory that does not exist, or a file, is refused at start naming it."""
    from vllm_smoe.formats.placement_file import read_snapshot
    from vllm_smoe.serving import plugin
    from vllm_smoe.serving.config import SmoeConfig, SmoeSettingsError

    served, extra = tmp_path / "served", tmp_path / "extra"
    served.mkdir()
    extra.mkdir()
    a = _placement(served / "a.yaml")
    cfg = SmoeConfig.from_dict({"placement": a, "placement_dirs": [str(extra)]})
    assert set(cfg.placement_dirs) == {str(served), str(extra)}
    read_snapshot(_placement(served / "b.yaml"), cfg.placement_dirs)  # the served directory stays allowed
    read_snapshot(_placement(extra / "c.yaml"), cfg.placement_dirs)
    cfg.check_files()
    (tmp_path / "afile").write_text("x")
    for bad in (str(tmp_path / "missing"), str(tmp_path / "afile")):
        given = SmoeConfig.from_dict({"placement": a, "placement_dirs": [str(extra), bad]})
        with pytest.raises(ValueError, match=f"{bad}: field 'placement_dirs'"):
            given.check_files()
        with pytest.raises(SmoeSettingsError, match=bad):  # under vllm serve: one line, exit 2
            plugin._before_engine_config(SimpleNamespace(additional_config={"smoe": given.to_dict()}))
