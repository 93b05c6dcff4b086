#!/usr/bin/env bash
# smoe on vLLM's CUDA build, on one NVIDIA GPU, in <= 10 minutes including the install:
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # OUT_DIR: default $OUT, else ./gpu-check
#
# Ran on one H200 on 2026-12-04 with GPU_CHECK_PYTHON=python3 (that machine reached no package
# registry, so no vLLM): (a), (b), (e) passed; (c) and the install path have not run on a GPU.
#
# Stages, each under a timeout: the venv (`make install SMOE_EXTRA=gpu`, skipped when its stamp
# is there; a venv holding the CPU build is never reused: .venv-gpu then), `nvidia-smi -L`, then
# `python benchmarks/gpu_check.py --out OUT_DIR`, which leaves OUT_DIR/gpu_check.json (rewritten
# after every check, so a run cut short still leaves what it had) and OUT_DIR/logs/*.log:
#  (a) speculate's device predictor + token order at L=48 MoE layers, N=8 ranks, T in
#      {1, 256, 8192}, H in {2048, 7168} bf16 rows, random tables: predict_token_tables ->
#      assign_permute (the Triton kernel, kernels/assign.py) -> x.index_select(0, perm[0]) and
#      back; perm/inv exactly equal to the numpy path the tests use (predict_layer ->
#      assign_tokens -> stable argsort), eager and as a CUDA-graph replay after the ids changed in
#      place, under torch.cuda.set_sync_debug_mode("error"); kernel == torch ops (assign +
#      permutation); CUDA-event times of both paths. Odd shapes (partial blocks, N = 6, T < N).
#  (b) the same step under torch.compile(fullgraph=True), captured in a CUDA graph and replayed.
#  (c) the trained fixture served at TP=1 with CUDA graphs (vLLM's offline LLM API, one process
#      per configuration, 5 engine starts): mode place greedy-equal to plain vLLM (fp32, bf16);
#      a smoe recording's per-token top-k equal to vLLM's own --enable-return-routed-experts
#      capture of the same requests; speculate at TP=2 + EP on the default all2all backend
#      refused ("... ignores token order ...") before any engine or worker process starts (with
#      one GPU vLLM's own device-count check may come first: then retried with
#      distributed_executor_backend="mp", both outcomes recorded).
#  (d) vLLM / torch / triton / CUDA versions, the device, wall time per check.
#  (e) the learned predictor on the device against its numpy twin; its per-step order as served,
#      eager and as a graph replay under the sync debug mode.
# Exit status: 0 every check passed; 1 a check failed or was skipped for time (the JSON names
# it); 124 / other: a stage timed out or failed (its log is under OUT_DIR/logs/).
# Knobs: GPU_CHECK_PYTHON (an interpreter holding torch and triton, e.g. python3: no venv and no
# install, for a machine that reaches no package registry; (c) is then recorded as skipped),
# GPU_CHECK_TOTAL_S (570: the whole run, install included; checks that would not end in
# time are skipped and recorded), GPU_CHECK_UV (1: fill the venv with uv first, then make install
# finds everything in place; 0: pip only), VENV (.venv), GPU_CHECK_ONLY (name prefixes, e.g.
# "compiled place_vs_plain_bfloat16": a second run of what a first one skipped for time; the
# install is skipped then). A second run overwrites OUT_DIR/gpu_check.json: give it another OUT_DIR.
#
# Plan for 8 GPUs (one node, 8 x H100/H200 over NVLink; not scripted yet, in this order):
#  1. This script (one GPU of the eight is enough for it).
#  2. Transport: NVSHMEM from PyPI (nvidia-nvshmem-cu12) and DeepEP built against it as vLLM's
#     tools/ep_kernels/ scripts do; `vllm serve --all2all-backend deepep_low_latency` at TP=8 +
#     EP without smoe first (vLLM's own path), then with --plugin smoe.
#  3. Exactness: the fixture at TP=8 + EP, mode speculate with configs/tiny-4dom-ep8.yaml
#     (predictors tables, tables-markov, router, random, one-rank), greedy tokens equal plain
#     TP=8 + EP over the same backend, eager and with CUDA graphs; recording left on under
#     speculate equal to a plain --enable-return-routed-experts run (as (c) here); the refusal of
#     (c) reached at attempt 1 (8 GPUs pass vLLM's device count); --all2all-backend
#     deepep_high_throughput (graphs turned off at DP=1) greedy-equal too.
#  4. Cost: the fixture widened to production rows (smoe-testbed inflate --hidden 7168
#     --moe-intermediate 2048), its placement built from its own recording, `smoe-bench serve` at
#     TP=8: TPOT / TTFT / tok/s of speculate vs plain TP=8 + EP over DeepEP LL, smoe's counters'
#     local share against the placement's lar; `smoe-bench kernels` and (a) at N=8 beside them.
#  5. DP=8 + EP, mode place with a DP placement (smoe-place build --mode dp) and request routing
#     vs vLLM's DP + EP: TTFT of long prompts and bytes per token; live re-placement
#     (POST /smoe/placement) under CUDA graphs at TP=8 speculate.
#  6. Issue 62's CUDA paths, none of which has run on a GPU (status in README.md, "On vLLM's CUDA
#     build", one table): in step 3, speculate over deepep_low_latency must log the MoE-buffer line
#     ("max_num_tokens N per rank") and its DeepEP RDMA buffer must match
#     tests/unit/test_moe_buffers.py's number; in steps 3 and 5, --enable-ep-weight-filter must
#     log each rank reading 1/8 of the expert bytes; --speculative-config with an EAGLE or MTP
#     draft (never served: the CPU build has none for the fixture) must serve tokens equal to plain
#     vLLM with the same draft in place and record modes, and the recording must equal
#     --enable-return-routed-experts; at DP=2 x TP=4 + EP the recording must equal it too (vLLM's
#     sequence-parallel MoE: the sp-chunk layout); a live swap on a Qwen3-Next checkpoint must
#     keep greedy tokens equal to a fresh start with the new placement; the start-up advice over
#     allgather_reducescatter at DP=8 must name deepep_high_throughput / deepep_low_latency.
#     Run on vLLM 0.32.0 and 0.33.0 both.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${1:-${OUT:-./gpu-check}}
mkdir -p "$OUT_DIR/logs"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOGS=$OUT_DIR/logs
T0=$(date +%s)
TOTAL_S=${GPU_CHECK_TOTAL_S:-570}
VENV=${VENV:-.venv}
if [ -e "$VENV/.smoe-installed-cpu" ] && [ ! -e "$VENV/.smoe-installed-gpu" ]; then
    echo "gpu_check: $VENV holds vLLM's CPU build; using .venv-gpu"
    VENV=.venv-gpu
fi
BIN=$VENV/bin
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

left() { echo $(( TOTAL_S - ($(date +%s) - T0) )); }

echo "== nvidia-smi -L"
timeout 30 nvidia-smi -L 2>&1 | tee "$LOGS/nvidia-smi.txt" || echo "gpu_check: nvidia-smi failed (rc $?)"

if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
    # a machine that reaches no package registry: the interpreter that holds torch and triton,
    # smoe put on its path as the installed layout has it (kernels/ and placement/ under
    # vllm_smoe/); (c) then records that vLLM is missing instead of running
    echo "== no install: $GPU_CHECK_PYTHON, smoe from a copy on PYTHONPATH"
    SHIM=$(mktemp -d)/site
    mkdir -p "$SHIM"
    cp -r vllm_smoe "$SHIM/vllm_smoe"
    cp -r kernels "$SHIM/vllm_smoe/kernels"
    cp -r placement "$SHIM/vllm_smoe/placement"
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
    PY=$(command -v "$GPU_CHECK_PYTHON")
else
echo "== install ($VENV)"
if [ -e "$VENV/.smoe-installed-gpu" ] && [ -x "$BIN/python" ]; then
    echo "gpu_check: already installed ($VENV/.smoe-installed-gpu)"
else
    {
        # a bare Debian/Ubuntu image may lack make or python3's venv module
        missing=()
        command -v make >/dev/null || missing+=(make)
        python3 -c "import ensurepip, venv" 2>/dev/null || missing+=(python3-venv)
        if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null; then
            echo "gpu_check: apt-get install ${missing[*]}"
            { timeout 90 apt-get update -qq && timeout 120 apt-get install -y -qq "${missing[@]}"; } \
              || echo "gpu_check: apt-get failed (rc $?)"
        fi
        if [ "${GPU_CHECK_UV:-1}" = 1 ]; then
            # uv resolves and downloads the same PyPI packages several times faster than pip;
            # make install below then only finds them in place (and writes its stamp)
            ( timeout 60 python3 -m venv "$VENV" \
              && timeout 60 "$BIN/pip" install -q uv \
              && timeout "$(( $(left) - 200 > 60 ? $(left) - 200 : 60 ))" \
                 "$BIN/uv" pip install --python "$BIN/python" -e ".[gpu,testbed,test]" ) \
              || echo "gpu_check: the uv pre-install failed (rc $?); make install does it with pip"
        fi
        timeout "$(( $(left) - 150 > 60 ? $(left) - 150 : 60 ))" make install SMOE_EXTRA=gpu VENV="$VENV"
    } 2>&1 | tee "$LOGS/install.log"
fi
PY=$BIN/python
fi
echo "gpu_check: install done at $(( $(date +%s) - T0 )) s"

LEFT=$(left)
BUDGET=$(( LEFT - 40 > 60 ? LEFT - 40 : 60 ))
echo "== benchmarks/gpu_check.py (budget ${BUDGET} s)"
rc=0
timeout --kill-after=20 "$(( BUDGET + 30 ))" \
    "$PY" benchmarks/gpu_check.py --out "$OUT_DIR" --budget-s "$BUDGET" ${GPU_CHECK_ONLY:+--only $GPU_CHECK_ONLY} \
    2>&1 | tee "$LOGS/gpu_check.log" \
    || rc=$?
echo "gpu_check: rc $rc after $(( $(date +%s) - T0 )) s; results in $OUT_DIR/gpu_check.json"
exit "$rc"
