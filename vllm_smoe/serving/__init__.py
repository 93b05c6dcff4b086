"""The vLLM side of smoe: everything that runs inside vLLM's processes.

- ``plugin``: the ``vllm.general_plugins`` entry point (flags, settings, checks before serving);
- ``loader``, ``load_plan``: the placement applied at load (expert weights renamed to slots);
- ``recorder``: record mode (routing captured into buffers, written as traces);
- ``cpu_ep``: vLLM's expert parallelism on its CPU build (experts honour ``expert_map``; the
  communicator with ``all_gatherv`` / ``reduce_scatterv``);
- ``sparse_a2a``: smoe's sparse de-duplicated all2all manager;
- ``device_predict``, ``token_order``: speculate's token order around vLLM's MoE;
- ``capability``: what speculate can serve, as ``(ok, reason)``.

The shared formats (``vllm_smoe.trace``, ``vllm_smoe.placement_file``) and the offline tools
(``vllm_smoe.placement``, ``smoe-place``, ``smoe-bench``, ``smoe-testbed``) need no vLLM.
"""
