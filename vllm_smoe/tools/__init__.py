"""smoe's command lines and what only they need (no vLLM import at start).

- ``place``: ``smoe-place`` (build, evaluate, advise, report), one module per part, over the pure
  pipeline in ``vllm_smoe.placement``; ``report``: its figures;
- ``trace_cli``: ``smoe-trace`` (validate, info, recover);
- ``testbed_cli``: ``smoe-testbed`` (tiny models, training, inflating, synthetic traces);
- ``bench``: ``smoe-bench``, one module per family of subcommands over ``bench.common``;
- ``demo``: ``make demo``; ``server_process``: a ``vllm serve`` subprocess for demo, benches, tests;
- ``cli_util``: one-line errors with exit 2, argparse number types, output checks;
- ``parallel``: smoe-place's fork-based map over layers; ``peers``: vLLM's EPLB policy as a peer.
"""
