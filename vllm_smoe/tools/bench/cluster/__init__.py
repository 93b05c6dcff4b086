"""``smoe-bench cluster``: vLLM nodes in network namespaces, joined by a veth shaped (tbf) to a
real cluster's proportions (the host's speed over the target's, :mod:`.link`; method in
docs/benchmarks/goodput.md and BENCHMARKS.md); every configuration served end to end on the same
prompts and model, the veth's and smoe's byte counters read around each load. Needs root and
iproute2; everything it makes is removed on exit.

Parts: link (targets, derived links), readings (veth, sockets, /metrics), slo and goodput
(latencies, SLO rates, attainment, the rate search), mixes (request lengths and prompts), netns
(namespaces, shaping, probe, teardown), wire (the exchange alone on the veth), configs (flags and
placements), nodes (one configuration's two nodes and client), client and goodput_client (the
loads inside namespace 0), run and goodput_plan (phases, targets, configurations), exchange_only,
report and goodput_report (tables, markdown, plots), cli (flags and the ``python -m`` entries).
The pure parts are tested in CI without root.
"""
