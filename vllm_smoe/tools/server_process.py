"""Start a ``vllm serve`` subprocess, wait for /health, talk to it with the openai client.

Used by the demo, the benchmarks and the tests; not needed to use the plugin itself.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

# fp32 and small memory: what exact comparisons on vLLM's CPU build need
CPU_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--gpu-memory-utilization", "0.15",
            "--max-num-seqs", "8", "--seed", "0")


def attention_args(model: str) -> tuple[str, ...]:
    """``--attention-backend CPU_MLA`` for an MLA model (DeepSeek's ``kv_lora_rank``) on vLLM's
    CPU build: on CPUs with AMX vLLM 0.32 otherwise picks its AMX MLA backend, which refuses fp32
    weights ("expect weight to be bfloat16"). () for other models, or a model dir without config."""
    import json

    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return ()
    return ("--attention-backend", "CPU_MLA") if isinstance(cfg, dict) and cfg.get("kv_lora_rank") else ()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_executable() -> str:
    return os.path.join(os.path.dirname(sys.executable), "vllm")


class VllmServer:
    """``with VllmServer(model, *args, log=path) as s: s.complete(...)``; ``started_s`` is the
    time from launch to a healthy server."""

    def __init__(self, model: str, *extra: str, log: str, base_args=CPU_ARGS, env: dict | None = None,
                 api_key: str | None = None):
        self.model = model
        self.api_key = api_key  # passed as --api-key; the client sends it
        if api_key is not None:
            extra = (*extra, "--api-key", api_key)
        self.port = free_port()
        self.log = str(log)
        self.t0 = time.monotonic()
        self.started_s: float | None = None
        self.proc = subprocess.Popen(
            [vllm_executable(), "serve", model, "--host", "127.0.0.1", "--port", str(self.port), *base_args,
             *(attention_args(model) if base_args is CPU_ARGS else ()), *extra],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})})

    def wait(self, timeout: float = 300.0) -> "VllmServer":
        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; log {self.log}:\n"
                                   + open(self.log).read()[-4000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        self.started_s = time.monotonic() - self.t0
                        return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve not healthy after {timeout} s; log {self.log}")

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=self.api_key or "smoe")

    def headers(self) -> dict:
        """HTTP headers for smoe's own routes (the API key, when the server has one)."""
        return {"Content-Type": "application/json",
                **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}

    def complete(self, prompts, max_tokens: int = 8) -> list[tuple[str, list[float]]]:
        """Greedy completions with per-token logprobs, one request per prompt (text or token ids)."""
        c = self.client()
        out = []
        for p in prompts:
            r = c.completions.create(model=self.model, prompt=p, max_tokens=max_tokens, temperature=0.0, logprobs=1)
            ch = r.choices[0]
            out.append((ch.text, list(ch.logprobs.token_logprobs)))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> "VllmServer":
        return self.wait()

    def __exit__(self, *exc) -> None:
        self.stop()
