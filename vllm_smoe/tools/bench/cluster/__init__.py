"""``smoe-bench cluster``: vLLM nodes in network namespaces, joined by a link shaped to a real
cluster's proportions; every configuration served end to end on the same prompts and model.

Why proportions: what decides the all-to-all's share of a step is a GPU's own speed over its
link, not the link's absolute rate. The host is measured first (fp32 GEMM throughput for
prefill, weight-read bandwidth for a decode-like GEMV, one thread: one core is one node here),
then the link gets ``rate = host speed / target ratio`` (``TARGETS``: an H200 over NDR
InfiniBand, NVLink, PCIe 5) and a delay of the target's latency times the same slow-down, so
the bandwidth-delay product in bytes stays the target's. tbf shapes each veth end with a bucket of a few
frames, so that every message pays its size; netem adds the delay where the kernel has it (the
JSON says whether it did).

Each configuration starts one vLLM node per namespace (TP across nodes with ``--nnodes``, or
vLLM's multi-node data parallel with ``--data-parallel-size-local 1`` and ``--headless``); a
client inside namespace 0 runs fixed-concurrency mixes and Poisson arrivals, reading the veth
byte counters (``/sys/class/net/*/statistics``) and smoe's own counters (``smoe:a2a_bytes`` on
``/metrics``) around each. Needs root and iproute2 (ip, tc; ethtool turns segmentation offloads off); everything it
makes (namespaces, veth, processes) is removed on exit and its traffic stays on its own veth.

The parts, each a module:

  link          -- the targets; the link derived from the host's speed and a target's proportions
  readings      -- the veth's counters, the sockets' bytes by process, smoe's counters on /metrics
  slo           -- a load's latencies, the SLO throughput of a Poisson ladder
  netns         -- the two namespaces and their veth, tc shaping, the link probe, teardown
  wire          -- the wire check: the MoE exchange alone on gloo ranks across the veth
  configs       -- the configurations served (vLLM's flags) and the placements they serve
  nodes         -- one configuration served: its two vLLM nodes and the client, started and stopped
  client        -- inside namespace 0: each phase's load with the readings around it
  run           -- the run: phases planned; per target the link shaped, every configuration served
  exchange_only -- --exchange-only: the exchange alone per target, the cost model beside it
  report        -- the summary, the printed table, BENCHMARKS.md's markdown, the plot
  cli           -- the subcommand's flags, and the internal entries ``python -m`` runs (__main__)

The pure parts (link derivation, readings, SLO throughput, report) are tested in CI without root.
"""
