"""The vLLM side of smoe: everything that runs inside vLLM's processes, grouped by what runs (the
formats, :mod:`vllm_smoe.formats`, and the offline tools, ``smoe-place`` / ``-bench`` / ``-testbed``, need no vLLM).

Core: ``plugin`` (the ``vllm.general_plugins`` entry point: flags, settings, checks before
serving), ``config`` (smoe's one frozen settings object, from ``additional_config``), ``served``
(the placement this process serves), ``patches`` (every change to vLLM, listed and checked at
start), ``runner_hooks`` (per-step hooks on vLLM's model runners), ``endpoints`` (smoe's HTTP
routes), ``advice`` (start-up advice).

- ``record/``: routing captured (``capture``) and written as traces, in any mode and layout;
- ``place/``: a placement applied at load, checked, and swapped live;
- ``speculate/``: the token order around vLLM's expert-parallel MoE;
- ``exchange/``: vLLM's EP on its CPU build, smoe's sparse all2all, collectives, topology;
- ``dp/``: whole requests routed to the data-parallel engine their experts live on;
- ``observe/``: counters, drift, ``/metrics``."""
