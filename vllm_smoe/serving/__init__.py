"""The vLLM side of smoe: everything that runs inside vLLM's processes.

- ``plugin``: the ``vllm.general_plugins`` entry point (flags, settings, checks before serving);
- ``config``: smoe's one frozen settings object, read from ``additional_config``;
- ``patches``: every replacement of a vLLM symbol, in one list, applied and checked at start;
- ``loader``, ``load_plan``: the placement applied at load (expert weights renamed to slots);
  ``expert_filter``: each rank reads only the experts of its placed slots (vLLM's EP weight filter);
- ``recorder``: routing captured into buffers and written as traces, in any mode;
- ``draft``, ``draft_rows``: speculative decoding: a draft model is left to vLLM; a recording
  keeps the rows of the tokens sampling kept;
- ``runner_hooks``: smoe's per-step hooks on vLLM's model runners;
- ``cpu_ep``: vLLM's expert parallelism on its CPU build (experts honour ``expert_map``; the
  communicator with ``all_gatherv`` / ``reduce_scatterv``; rotary embedding for MLA);
- ``sparse_a2a``: smoe's sparse de-duplicated all2all manager;
- ``device_predict``, ``token_order``: speculate's token order around vLLM's MoE;
- ``dp_router``: whole requests to the data-parallel rank their experts live on;
- ``live``, ``endpoints``: live re-placement and smoe's HTTP routes; ``metrics``: ``/metrics``;
- ``capability``: what speculate can serve, as ``(ok, reason)``.

The shared formats (:mod:`vllm_smoe.formats`) and the offline tools (:mod:`vllm_smoe.placement`,
:mod:`vllm_smoe.tools`: ``smoe-place``, ``smoe-bench``, ``smoe-testbed``) need no vLLM.
"""
