# tests/interp/ needs TRITON_INTERPRET=1 before triton is imported; tests/test_kernels.py runs it
# in a child process, so the main session never collects it.
collect_ignore = ["interp"]

import os  # noqa: E402

import pytest  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

# Under pytest-xdist (``make test``: --dist loadgroup --no-loadscope-reorder) the files that take
# longest are sent first, so that no engine-heavy file is left for the end while the other worker
# idles (xdist's own order, by number of tests, would send test_dp_routing's 3 tests and the
# one-test files last). Order from the slowest tests of two serial CI runs (2026-12-07); files not
# named follow in collection order.
HEAVY_FIRST = ("vllm/test_dp_routing.py", "vllm/test_speculate.py", "vllm/test_deepseek.py",
               "vllm/test_architectures.py", "vllm/test_record_stop.py", "vllm/test_record.py",
               "vllm/test_draft.py", "vllm/test_readme_quickstart.py", "vllm/test_uneven.py",
               "vllm/test_inflate.py", "vllm/test_metrics_probes.py", "unit/test_place_cli.py",
               "unit/test_auto_replace.py", "vllm/test_metrics.py", "vllm/test_serve.py",
               "vllm/test_vllm_load.py", "vllm/test_hardening.py")
# Files run by the same worker as another (one xdist group): plain_served (tests/vllm/conftest.py)
# is made once per worker, so its users share one.
SAME_WORKER = {"vllm/test_serve.py": "vllm/test_dp_routing.py"}


def pytest_configure(config):
    from tests.support import BUILDS_ENV, one_core

    # the run's build directory (tests.support.built), made by the process that starts the run
    # (xdist's controller, or the only one) and shared by its workers, which inherit it
    if not os.environ.get(BUILDS_ENV):
        import tempfile

        os.environ[BUILDS_ENV] = config._smoe_builds = tempfile.mkdtemp(prefix="smoe-test-builds-")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # a one-rank engine started without a binding (vLLM's "auto" is core 0 on this host) runs
        # on this worker's core; every engine of more ranks names its cores ("0|1", ...)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", one_core())
    try:  # a busy host (two workers, engines on both cores) can hold any example past 200 ms
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile("smoe", deadline=None)
    settings.load_profile("smoe")


def pytest_unconfigure(config):
    made = getattr(config, "_smoe_builds", None)
    if made:
        import shutil

        from tests.support import BUILDS_ENV

        shutil.rmtree(made, True)
        os.environ.pop(BUILDS_ENV, None)


@pytest.hookimpl(tryfirst=True)  # before xdist's worker names the groups
def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a plain run keeps pytest's order

    def rel(item):
        return os.path.relpath(str(item.path), HERE).replace(os.sep, "/")

    rank = {f: i for i, f in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(rel(item), len(rank)))  # stable: same order on every worker
    if config.getoption("loadgroup", False):  # a file is a group (as --dist loadfile), SAME_WORKER joined
        for item in items:
            item.add_marker(pytest.mark.xdist_group(SAME_WORKER.get(rel(item), rel(item))))


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
