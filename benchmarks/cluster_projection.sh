#!/usr/bin/env bash
# Projections of issue 67 (BENCHMARKS.md "What a placement buys on a real cluster"): synthetic
# routing at DeepSeek-V3 and Qwen3-235B shapes (generator settings fixed here, before any
# placement: the defaults, seed 0, 4 MoE layers, DeepSeek-V3 group-limited 4 of 8), smoe's default
# placement (coclust, --nodes, as build makes it) against vLLM's linear order and EPLB, projected
# on H100 x 8 + NDR 400 over DeepEP high-throughput and low-latency, decode (128 tokens per rank)
# and prefill (4096). Writes docs/cluster-projection/<shape>-ep<N>-<phase>.json.
#   benchmarks/cluster_projection.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
W=${1:-/tmp/smoe-projection}
OUT=docs/cluster-projection
mkdir -p "$W" "$OUT"
for shape in deepseek-v3 qwen3-235b-a22b; do
  g=""; [ "$shape" = deepseek-v3 ] && g="--groups 8 --topk-group 4"
  [ -f "$W/$shape/trace-00002.npz" ] || $BIN/smoe-testbed synth --shape "$shape" --tokens 786432 --seed 0 --layers 4 \
      --file-tokens 262144 $g -o "$W/$shape" > /dev/null
  bg=""; [ "$shape" = deepseek-v3 ] && bg="--groups 8"
  for ep in 16 32 64; do
    p="$W/$shape-ep$ep.yaml"
    [ -f "$p" ] || $BIN/smoe-place build --trace "$W/$shape/trace-00000.npz" --ep-size $ep --nodes $((ep / 8)) $bg -o "$p" 2>&1 | tail -1
    for phase in decode:128 prefill:4096; do
      $BIN/smoe-place evaluate --trace "$W/$shape/trace-00001.npz" "$W/$shape/trace-00002.npz" --placement "$p" \
          --compare linear,eplb --cluster h100x8-ndr400 --backend deepep-ht,deepep-ll,allgather-rs \
          --tokens-per-rank "${phase#*:}" --cost-shape "$shape" --json "$OUT/$shape-ep$ep-${phase%%:*}.json" \
          2>&1 | grep -v '%|' | tail -22
    done
  done
done
