# tests/interp/ needs TRITON_INTERPRET=1 before triton is imported; tests/test_kernels.py runs it
# in a child process, so the main session never collects it.
collect_ignore = ["interp"]

import pytest  # noqa: E402


@pytest.fixture
def gloo_spawn():
    """``run(worker, world) -> {rank: result}``: ``worker(rank, port, results)`` in ``world``
    processes that join one gloo group on a free local port and put their result in ``results``."""
    import socket

    import torch.multiprocessing as mp

    def run(worker, world: int) -> dict:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        results = mp.Manager().dict()
        mp.spawn(worker, args=(port, results), nprocs=world, join=True)
        return {r: results[r] for r in range(world)}

    return run
