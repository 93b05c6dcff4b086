"""Every replacement of a vLLM symbol smoe makes, in one list, applied through one function.

vLLM 0.32 and 0.33 have seams for most of what smoe does (plugins, model loaders, ``additional_config``,
all2all managers, router capture, worker extensions); where it has none, smoe replaces a symbol.
Each replacement is a :class:`Patch` in :data:`PATCHES`. The replacements are thin and live here,
one module per part of vLLM (``engine_args``, ``cli``, ``cpu``, ``runners``, ``dp_client``,
``model_loader``); what they run is smoe's, in the feature modules (``where``). Each lands only
through :func:`replace`, which refuses a symbol not in the list, one whose target moved, and one
whose original's parameters differ from what the patch was written for (:func:`mismatches`).
``tests/unit/test_patches.py`` fails when code patches a vLLM symbol that is not here.

Private vLLM names smoe reads without replacing them are in :data:`PRIVATE_READS`, checked the
same way at start. To remove a patch: delete its entry and its ``replace`` call; the test names
any leftover."""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass

logger = logging.getLogger("vllm.smoe")

# the vLLM releases smoe's GPU extra takes; each is stored in signatures.json (regenerated from the
# release's wheel by ``python -m vllm_smoe.tools.vllm_signatures``) and checked against both lists
# below by tests/unit/test_vllm_signatures.py
SUPPORTED_VLLM: tuple[str, ...] = ("0.32.0", "0.33.0")


@dataclass(frozen=True)
class Patch:
    """One replacement: the symbol, why, the upstream issue or PR, what vLLM would need to offer
    for the patch to go, and the parameters of vLLM's original as it was checked (vLLM versions
    in ``checked_on``; what each release defines, read from its wheel, is stored in
    ``signatures.json`` and compared in CI)."""

    id: str
    target: str  # "module:Qualname.attr" where vLLM defines it
    kind: str  # method, staticmethod, classmethod, property, __init__, function
    params: tuple[str, ...]  # the parameter names of vLLM's original, as checked
    where: str  # smoe's module (function) that installs it
    why: str
    upstream: str
    remove: str  # what vLLM would need to offer for the patch to go
    checked_on: tuple[str, ...] = SUPPORTED_VLLM
    optional: bool = False  # the target may not import on every build (then it is not applied)
    platform: str = ""  # "cpu" / "cuda": applied only there (else wherever smoe runs)


PATCHES: tuple[Patch, ...] = (
    Patch(
        id='engine_args_add_cli_args',
        target='vllm.engine.arg_utils:EngineArgs.add_cli_args',
        kind='staticmethod',
        params=('parser',),
        where='patches/engine_args.py; runs plugin._add_flags',
        why='Adds `--plugin smoe` and the `--smoe-*` flags (argument group "smoe"). `vllm serve` reaches it through AsyncEngineArgs.add_cli_args, which calls EngineArgs.add_cli_args by name (with async_args_only=True the flags are not added).',
        upstream="none filed; related: vllm-project/vllm#42318 '[Feature] Plugin config cli' (closed; reviewer: use --additional-config) https://github.com/vllm-project/vllm/pull/42318",
        remove="vLLM lets a plugin contribute its own argument group to vLLM's parsers (a CLI-args plugin hook)",
    ),
    Patch(
        id='engine_args_from_cli_args',
        target='vllm.engine.arg_utils:EngineArgs.from_cli_args',
        kind='classmethod',
        params=('cls', 'args'),
        where='patches/engine_args.py; runs plugin._fold_flags',
        why="Folds the `--smoe-*` flags into additional_config['smoe'] (flags win over --additional-config), refuses `--smoe-*` without `--plugin smoe`, and writes the folded config back into the argparse namespace because DP's extra API servers rebuild their engine args from it.",
        upstream='none filed (see #42318 above)',
        remove="vLLM maps plugin-owned CLI arguments into the plugin's config (e.g. additional_config) itself",
    ),
    Patch(
        id='engine_args_create_load_config',
        target='vllm.engine.arg_utils:EngineArgs.create_load_config',
        kind='method',
        params=('self',),
        where='patches/engine_args.py; runs plugin._load_config',
        why="Selects the `smoe` model loader (load_format='smoe') when a placement or recording is set; refuses load formats other than auto/safetensors/smoe.",
        upstream='none filed',
        remove='a plugin hook that may choose the load format from plugin config (or require users to pass --load-format smoe; the loader registry itself is public)',
    ),
    Patch(
        id='engine_args_create_engine_config',
        target='vllm.engine.arg_utils:EngineArgs.create_engine_config',
        kind='method',
        params=('self', 'usage_context', 'headless'),
        where='patches/engine_args.py; runs plugin._before_engine_config, _after_engine_config',
        why="Validates smoe's settings and the placement against the model before anything is served (SmoeSettingsError -> one line, exit 2), normalises paths, registers the /metrics collector, sets worker_extension_cls, sets parallel_config.smoe_sequence_parallel for speculate, logs advice, loads DP tables; _check_engine_args refuses --enable-return-routed-experts with record/speculate, refuses sparse all2all off CPU and turns CUDA graphs off for deepep_high_throughput at DP=1.",
        upstream='none filed',
        remove='a plugin hook to validate/finalise engine args and the built VllmConfig (pre- and post-create_engine_config)',
    ),
    Patch(
        id='serve_cmd',
        target='vllm.entrypoints.cli.serve:ServeSubcommand.cmd',
        kind='staticmethod',
        params=('args',),
        where='patches/cli.py',
        why="`vllm serve`: a smoe settings error is one line on stderr and exit code 2, not a traceback (vLLM's CLI has no hook for a plugin's refusal).",
        upstream='none filed',
        remove="vLLM's CLI turns a plugin's settings error (a dedicated exception type) into a clean exit code",
    ),
    Patch(
        id='runner_v1_execute_model',
        target='vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model',
        kind='method',
        params=('self', 'scheduler_output', 'intermediate_tensors'),
        where='patches/runners.py (wrap_runner); runs runner_hooks._served',
        why="Runs smoe's host work around every served step (recorder copies, token-order counters/log, metrics, drift, the step's real token count), outside any CUDA graph; skips dummy runs and anything before warm-up ends.",
        upstream="none filed; related open PR vllm-project/vllm#37002 'Observation Plugin for Intercepting & Routing on Activations' (a per-step hook in gpu_model_runner) https://github.com/vllm-project/vllm/pull/37002",
        remove="a per-step plugin hook on model runners (before/after the forward, with the step's batch view and a warm-up flag)",
    ),
    Patch(
        id='runner_v2_execute_model',
        optional=True,
        target='vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model',
        kind='method',
        params=('self', 'scheduler_output', 'intermediate_tensors', 'dummy_run', 'skip_attn_for_dummy_run', 'is_profile', 'context_len', 'valid_dummy_state_slots', 'randomize_inputs'),
        where='patches/runners.py (wrap_runner); runs runner_hooks._served',
        why="Same hooks for Model Runner V2 (CUDA's default); V2's dummy_run=True calls pass straight through.",
        upstream='as runner_v1_execute_model (#37002 related)',
        remove='as runner_v1_execute_model',
    ),
    Patch(
        id='gpu_worker_warm_up',
        platform='cuda',
        target='vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model',
        kind='method',
        params=('self',),
        where='patches/runners.py (wrap_worker); runs runner_hooks._warmed_up',
        why="Marks the end of warm-up (_SERVING=True) so the step hooks never see V2's JIT warm-up, which sends made-up requests through execute_model.",
        upstream='none filed',
        remove='the per-step hook above, with warm-up steps marked',
    ),
    Patch(
        id='cpu_worker_warm_up',
        platform='cpu',
        target='vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model',
        kind='method',
        params=('self',),
        where='patches/runners.py (wrap_worker); runs runner_hooks._warmed_up',
        why="Same as gpu_worker_warm_up for vLLM's CPU worker.",
        upstream='none filed',
        remove='as gpu_worker_warm_up',
    ),
    Patch(
        id='parallel_sequence_parallel_moe',
        target='vllm.config.parallel:ParallelConfig.use_sequence_parallel_moe',
        kind='property',
        params=('self',),
        where='patches/cpu.py (at_start)',
        why="smoe's token order needs vLLM's sequence-parallel MoE at DP=1 too (TP>1 + EP); vLLM turns it on only with DP>1. vLLM's backend whitelist still holds: on CPU always, elsewhere only the backends that honour token order. Also flips ParallelConfig.use_all2all, which reads this property.",
        upstream='not filed by smoe; upstream history: #48036 dropped the DP>1 condition, reported as a regression in vllm-project/vllm#48656 https://github.com/vllm-project/vllm/issues/48656 and restored by vllm-project/vllm#48849 (merged) https://github.com/vllm-project/vllm/pull/48849; vllm-ascend patches the same property (vllm-project/vllm-ascend#17061) https://github.com/vllm-project/vllm-ascend/pull/17061',
        remove='an opt-in ParallelConfig setting that enables sequence-parallel MoE at DP=1',
    ),
    Patch(
        id='cpu_platform_communicator_cls',
        target='vllm.platforms.cpu:CpuPlatform.get_device_communicator_cls',
        kind='classmethod',
        params=('cls',),
        where='patches/cpu.py (at_start); returns cpu_ep.SmoeCpuCommunicator',
        why="With smoe asked for, returns 'vllm_smoe.serving.exchange.cpu_ep.SmoeCpuCommunicator': vLLM's CpuCommunicator has no all_gatherv/reduce_scatterv (which allgather_reducescatter calls under DP/SP) and uses shared memory only for tp/pp groups; smoe's subclass adds both ops, SHM for the EP group, bit-exact integer all-gather and the sparse all2all manager; the worker that asks for it also gets cpu_experts_apply, eplb_map_cpu and moe_runner_select_forward. Outside a config context it is vLLM's own.",
        upstream="vllm-project/vllm#57837 '[WideEP][CPU]: Add a CPU-only Wide Expert Parallelism well-lit path' (open; the same all_gatherv/reduce_scatterv gap) https://github.com/vllm-project/vllm/issues/57837",
        remove='CpuCommunicator implements all_gatherv/reduce_scatterv and SHM for any same-node group, and vLLM lets a plugin pick the communicator / all2all manager',
    ),
    Patch(
        id='cpu_experts_apply',
        platform='cpu',
        target='vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts.apply',
        kind='method',
        params=('self', 'output', 'hidden_states', 'w1', 'w2', 'topk_weights', 'topk_ids', 'activation', 'global_num_experts', 'expert_map', 'a1q_scale', 'a2_scale', 'workspace13', 'workspace2', 'expert_tokens_meta', 'apply_router_weight_on_input'),
        where='patches/cpu.py (fix_cpu_experts); runs cpu_ep.local_pairs',
        why="vLLM hands the global topk_ids to cpu_fused_moe with only this rank's expert weights (expert_map ignored): out-of-bounds reads or garbage under --enable-expert-parallel. smoe maps ids through expert_map and computes only the local (token, expert) pairs. The zentorch branch of the original has the same gap and is covered too.",
        upstream='none filed (related: #57837 above)',
        remove="vLLM's CPU unquantized experts honour expert_map",
    ),
    Patch(
        id='eplb_map_cpu',
        platform='cpu',
        target='vllm.model_executor.layers.fused_moe.router.base_router:eplb_map_to_physical_and_record',
        kind='function',
        params=('topk_ids', 'expert_load_view', 'logical_to_physical_map', 'logical_replica_count', 'record_enabled', 'num_unpadded_tokens'),
        where='patches/cpu.py (fix_cpu_eplb_map); installs cpu_ep.map_to_physical',
        why="The logical->physical expert map is a Triton kernel on CUDA/ROCm/XPU and the identity elsewhere, so on CPU a redundant copy is never used (and a rearranged layout computes the wrong experts); smoe puts the kernel's semantics in torch. Effective because BaseRouter._apply_eplb_mapping looks the module global up at call time; modules that imported the name directly keep the identity: in 0.32 vllm/models/deepseek_v4/nvidia/model.py and vllm/models/kimi_k3/nvidia/model.py, in 0.33 vllm/model_executor/layers/fused_moe/deep_gemm_mega_moe.py (NVIDIA only).",
        upstream='none filed',
        remove='vLLM ships a torch implementation for platforms without its Triton kernel',
    ),
    Patch(
        id='rope_init',
        target='vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding.__init__',
        kind='__init__',
        params=('self', 'head_size', 'rotary_dim', 'max_position_embeddings', 'base', 'is_neox_style', 'dtype', 'init_cache'),
        where='patches/cpu.py (fix_cpu_rope)',
        why='Records per rotary module (instance attribute _smoe_rope) whether the vLLM config being built asks for smoe; a module built outside any vLLM config (AssertionError) gets False.',
        upstream='as rope_forward_cpu',
        remove='as rope_forward_cpu',
    ),
    Patch(
        id='rope_forward_cpu',
        target='vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding.forward_cpu',
        kind='method',
        params=('self', 'positions', 'query', 'key'),
        where='patches/cpu.py (fix_cpu_rope)',
        why='The CPU rotary_embedding op rotates [T, heads*dim] rows but not [T, heads, dim] ones (3-D query left as is, strided 3-D key rotated wrongly), which DeepSeek MLA and LFM2-MoE pass; smoe hands the op contiguous rows and copies back, only for modules built under smoe and 1-D positions.',
        upstream='none filed for CPU; the CUDA op got this fix in vllm-project/vllm#12777 https://github.com/vllm-project/vllm/pull/12777 (and slices in #18046 https://github.com/vllm-project/vllm/pull/18046)',
        remove="vLLM's CPU rotary_embedding op accepts 3-D and strided query/key (as the CUDA op does)",
    ),
    Patch(
        id='moe_runner_select_forward',
        platform='cpu',
        target='vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner._select_forward',
        kind='method',
        params=('self',),
        where='patches/cpu.py (opaque_moe_forward)',
        why='On CPU vLLM calls its fused-MoE forward directly, so torch.compile traces into the experts and the all2all; the expert-map fix and the sparse exchange have data-dependent sizes, so under smoe the CPU takes the opaque vllm::moe_forward / moe_forward_shared custom ops vLLM uses on GPUs.',
        upstream="none filed (vLLM's comment in _select_forward says CPU deliberately calls the op directly)",
        remove="a switch to use the opaque moe_forward op on CPU (or vLLM's CPU path tolerating data-dependent sizes)",
    ),
    Patch(
        id='weight_utils_should_skip_weight',
        target='vllm.model_executor.model_loader.weight_utils:should_skip_weight',
        kind='function',
        params=('weight_name', 'local_expert_ids'),
        where='patches/model_loader.py; runs expert_filter.should_skip',
        why="With --enable-ep-weight-filter, vLLM skips a per-expert tensor before reading it when its expert id is not in the loader's one set of local ids (its linear split, the same for every layer). A placement puts other experts, and copies, on a rank in each layer, so smoe's loader hands a per-layer set (expert_filter.PlacedExperts, the union as a set) and this asks it with the tensor's name; any other set goes to vLLM's function unchanged. Where not in force, vLLM tests the union: more is read, never less.",
        upstream="none filed; the filter came with vllm-project/vllm#37136 https://github.com/vllm-project/vllm/pull/37136, is skipped under EPLB since #37322 https://github.com/vllm-project/vllm/pull/37322 (redundant slots hold other ranks' experts) and opt-in since #37351",
        remove="vLLM's EP weight filter taking the model's expert map per layer (a static placement's or EPLB's physical-to-logical map), or a name predicate",
    ),
    Patch(
        id='dplb_get_core_engine_for_request',
        target='vllm.v1.engine.core_client:DPLBAsyncMPClient.get_core_engine_for_request',
        kind='method',
        params=('self', 'request'),
        where='patches/dp_client.py; runs dp_router._attach, _choose',
        why="Sends each request to the DP engine whose experts (under the placement) its prompt's tokens use most, within balance masks; named ranks, pooling and unseen prompts stay vLLM's. Uses vLLM's explicit-rank path for its bookkeeping.",
        upstream="none filed; related: vllm-project/vllm#43483 (open, prefix-cache-aware internal DP LB) https://github.com/vllm-project/vllm/pull/43483, #43279 (open, rewrites this method's scan) https://github.com/vllm-project/vllm/pull/43279, #52463 (tie-break rotation) https://github.com/vllm-project/vllm/issues/52463",
        remove="a pluggable routing policy for vLLM's internal DP load balancer",
    ),
    Patch(
        id='dplb_init',
        target='vllm.v1.engine.core_client:DPLBAsyncMPClient.__init__',
        kind='__init__',
        params=('self', 'vllm_config', 'executor_class', 'log_stats', 'client_addresses', 'client_count', 'client_index', 'renderer'),
        where='patches/dp_client.py; runs dp_router._attach, _choose',
        why="Builds the client's RequestRouter (placement tables read) while the server starts, not on its first request.",
        upstream='as dplb_get_core_engine_for_request',
        remove='as dplb_get_core_engine_for_request',
    ),
)

# (target, where, what for): private vLLM names read, never replaced; checked at start
PRIVATE_READS: tuple[tuple[str, str, str], ...] = (
    ("vllm.distributed.device_communicators.cpu_communicator:_CPUSHMDistributed", "serving/cpu_ep.py, sparse_a2a.py",
     "the shared-memory transport, run for the expert-parallel group; which transport a group uses"),
    ("vllm.model_executor.model_loader.default_loader:DefaultModelLoader._init_ep_weight_filter",
     "serving/loader.py", "overridden: vLLM's linear split of checkpoint ids replaced by the ids of this rank's placed "
     "slots per layer (expert_filter), or none for a draft"),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner:_moe_forward", "serving/cpu_ep.py",
     "the direct MoE forward the CPU picks, swapped for the opaque custom op"),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner:_moe_forward_shared", "serving/cpu_ep.py",
     "as _moe_forward, for blocks with shared experts"),
    ("vllm.v1.engine.core_client:DPLBAsyncMPClient", "serving/dp_router.py",
     "the front end's DP load balancer whose engine choice smoe's request routing takes over"),
    ("vllm.model_executor.model_loader.ep_weight_filter:compute_local_expert_ids", "serving/expert_filter.py",
     "vLLM's linear split, kept for MoE layers outside the placement so a rank never reads more than vLLM would"),
)

# target -> (kind, parameter names) smoe's code relies on, for each of PRIVATE_READS: None where
# smoe only names the object (isinstance, identity); _CPUSHMDistributed is constructed by smoe,
# _init_ep_weight_filter overridden by smoe's loader
PRIVATE_READ_SIGNATURES: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "vllm.distributed.device_communicators.cpu_communicator:_CPUSHMDistributed": ("class", ("self", "communicator")),
    "vllm.model_executor.model_loader.default_loader:DefaultModelLoader._init_ep_weight_filter":
        ("method", ("self", "model_config")),
    "vllm.model_executor.layers.fused_moe.runner.moe_runner:_moe_forward": ("function", None),
    "vllm.model_executor.layers.fused_moe.runner.moe_runner:_moe_forward_shared": ("function", None),
    "vllm.v1.engine.core_client:DPLBAsyncMPClient": ("class", None),
    "vllm.model_executor.model_loader.ep_weight_filter:compute_local_expert_ids":
        ("function", ("num_experts", "ep_size", "ep_rank", "placement")),
}

_BY_ID = {p.id: p for p in PATCHES}
_ORIGINALS: dict[str, object] = {}
_MISMATCHES: dict[str, str] = {}


def _resolve(target: str):
    """(owner, attr) of ``module:Qual.attr``; ImportError/AttributeError when vLLM lacks it."""
    module, qual = target.split(":")
    owner = importlib.import_module(module)
    *path, attr = qual.split(".")
    for name in path:
        owner = getattr(owner, name)
    return owner, attr


def _function(obj):
    """The function behind a staticmethod, classmethod or property."""
    for name in ("__func__", "fget"):
        inner = getattr(obj, name, None)
        if inner is not None:
            return inner
    return obj


def _params(obj) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(_function(obj)).parameters)  # follows decorators' __wrapped__
    except (TypeError, ValueError):
        return None


def _where(owner, attr: str) -> str:
    if inspect.ismodule(owner):
        return f"{owner.__name__}:{attr}"
    return f"{owner.__module__}:{owner.__qualname__}.{attr}"


def _differs(p: Patch, original) -> str:
    return (f"{p.target}: vLLM's has parameters {_params(original)}, smoe's patch was written for {p.params} "
            f"(vLLM {', '.join(p.checked_on)})")


def replace(patch_id: str, owner, attr: str, new) -> bool:
    """``owner.attr = new`` for the listed patch ``patch_id``: False (nothing replaced) when the
    original's parameters differ from the listed ones (recorded for :func:`mismatches`); a
    second call for an applied patch is a no-op. AssertionError for a patch not in the list or a
    target elsewhere than listed (smoe's own mistake, caught by the tests)."""
    p = _BY_ID.get(patch_id)
    assert p is not None, f"smoe patch {patch_id!r} is not in serving/patches PATCHES"
    assert _where(owner, attr) == p.target, f"smoe patch {patch_id}: {_where(owner, attr)} is not {p.target}"
    current = inspect.getattr_static(owner, attr)
    if getattr(_function(current), "_smoe_patch", None) == patch_id:
        return True
    if _params(current) != p.params:
        _MISMATCHES[patch_id] = _differs(p, current)
        logger.error("smoe: not patching %s", _MISMATCHES[patch_id])
        return False
    _function(new)._smoe_patch = patch_id
    _ORIGINALS[patch_id] = current
    setattr(owner, attr, new)
    return True


def require(patch_id: str, owner, attr: str, new) -> None:
    """:func:`replace` for a patch a mode cannot run without, applied while a server starts:
    ValueError naming the symbol when vLLM's original is not what the patch was written for."""
    if not replace(patch_id, owner, attr, new):
        raise ValueError(f"smoe: this vLLM is not the one smoe was written for: {_MISMATCHES[patch_id]}")


def original(patch_id: str):
    """vLLM's own object that patch ``patch_id`` replaced (as stored on the owner)."""
    return _ORIGINALS[patch_id]


def applied() -> dict[str, object]:
    """patch id -> vLLM's original, for the patches in force in this process."""
    return dict(_ORIGINALS)


def check(patch_id: str, owner, attr: str) -> str:
    """'' when ``owner.attr`` is what patch ``patch_id`` was written for, else the line naming it."""
    p = _BY_ID[patch_id]
    current = inspect.getattr_static(owner, attr, None)
    if current is None:
        return f"{p.target}: not in this vLLM"
    if getattr(_function(current), "_smoe_patch", None) == patch_id or _params(current) == p.params:
        return ""
    return _differs(p, current)


def mismatches(check_all: bool = False, import_all: bool = False) -> list[str]:
    """One line per patched vLLM symbol (and private name read) that is not what smoe was
    written for: those :func:`replace` refused so far, plus, with ``check_all``, every listed
    target whose module this process has imported (nothing is imported: on CUDA some of vLLM's
    CPU modules replace parts of torch when imported; the rest are checked when applied, by
    :func:`require`, before serving), or with ``import_all`` every listed target (tests).

    With smoe asked for, the plugin checks every listed symbol imported by then and refuses,
    naming each that differs; the worker-side ones are checked as they are applied, while the
    model loads."""
    import sys

    out = dict(_MISMATCHES)
    if check_all or import_all:
        for p in PATCHES:
            if p.id in out or (not import_all and p.target.split(":")[0] not in sys.modules):
                continue
            try:
                owner, attr = _resolve(p.target)
                obj = _ORIGINALS.get(p.id, inspect.getattr_static(owner, attr))
            except (ImportError, AttributeError) as e:
                if not p.optional:
                    out[p.id] = f"{p.target}: not in this vLLM ({type(e).__name__}: {e})"
                continue
            if _params(obj) != p.params:
                out[p.id] = _differs(p, obj)
        for target, where, _ in PRIVATE_READS:
            if not import_all and target.split(":")[0] not in sys.modules:
                continue
            try:
                _resolve(target)
            except (ImportError, AttributeError) as e:
                out[target] = f"{target} (read by {where}): not in this vLLM ({type(e).__name__})"
    return [out[k] for k in sorted(out)]
