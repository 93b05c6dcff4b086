"""vLLM general plugin ``smoe`` (entry point ``vllm.general_plugins``).

vLLM calls :func:`register` in every process, before ``vllm serve`` builds its parser. Through
:mod:`.patches` it hooks four of ``EngineArgs``' own steps, each a no-op unless smoe is asked
for (and installs the CPU fixes, the loader and the DP request router, each inert unless a
config asks); this module holds what those steps do:

- ``add_cli_args``: adds ``--plugin smoe`` and the ``--smoe-*`` flags (argument group "smoe");
- ``from_cli_args``: folds those flags into ``additional_config["smoe"]``;
- ``create_load_config``: selects the ``smoe`` model loader when a placement or recording is set;
- ``create_engine_config``: checks that this vLLM is the one smoe's patches were written for,
  validates the settings and the placement against the model, so a bad file stops the process
  before anything is served.

Settings then reach engine core and workers inside ``vllm_config.additional_config``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os

from .config import ALL2ALL, HIERARCHICAL, MODES, PREDICTORS, REDUCE_SCATTER, STACK_ORDERS

logger = logging.getLogger("vllm.smoe")  # under vLLM's logger: same handlers and level

_FLAGS = {  # CLI dest -> key in additional_config["smoe"]
    "smoe_placement": "placement",
    "smoe_placement_dirs": "placement_dirs",
    "smoe_record": "record",
    "smoe_mode": "mode",
    "smoe_log_interval": "log_interval",
    "smoe_predictor": "predictor",
    "smoe_all2all": "all2all",
    "smoe_dp_routing": "dp_routing",
    "smoe_auto_replace": "auto_replace",
    "smoe_record_sample": "record_sample",
    "smoe_record_max_mb": "record_max_mb",
    "smoe_metrics": "metrics",
    "smoe_reduce_scatter": "reduce_scatter",
    "smoe_hierarchical": "hierarchical",
    "smoe_stack_order": "stack_order",
}
_done = False
_API_SERVERS: list = [None]  # vllm serve's --api-server-count as its CLI settled it (None: not vllm serve)


def _add_flags(parser: argparse.ArgumentParser) -> None:
    if any(getattr(a, "dest", None) == "smoe_placement" for a in parser._actions):
        return
    g = parser.add_argument_group("smoe", "Speculative MoE plugin (https://github.com/smoe; docs/README.md)")
    g.add_argument("--plugin", choices=["smoe"], default=None,
                   help="enable the smoe plugin for this server (its --smoe-* flags need it)")
    g.add_argument("--smoe-placement", default=None, help="placement YAML written by smoe-place build")
    g.add_argument("--smoe-placement-dirs", default=None,
                   help=f"directories POST /smoe/placement takes placement files from besides the served "
                        f"placement's own, '{os.pathsep}'-separated; each must exist")
    g.add_argument("--smoe-record", default=None, help="directory to write routing traces into")
    g.add_argument("--smoe-record-sample", type=float, default=None,
                   help="with --smoe-record: share of requests recorded, whole requests (default 1.0)")
    g.add_argument("--smoe-record-max-mb", type=float, default=None,
                   help="with --smoe-record: disk budget of the trace files in MiB; the oldest are removed first "
                        "(default: no limit)")
    g.add_argument("--smoe-metrics", choices=["on", "off"], default=None,
                   help="smoe's counters on /metrics (default on); off also stops speculate's device counters, log "
                        "line and drift warnings")
    g.add_argument("--smoe-mode", choices=MODES, default=None,
                   help="place (default with a placement) | record (default with --smoe-record; applies "
                        "--smoe-placement too) | speculate (records too with --smoe-record)")
    g.add_argument("--smoe-log-interval", type=float, default=None,
                   help="seconds between smoe's log lines (recorder, speculate, DP routing and locality)")
    g.add_argument("--smoe-predictor", choices=PREDICTORS, default=None,
                   help="speculate: token -> rank predictor (default tables: the placement's trained tables; "
                        "learned: the small network smoe-place build --learned trains; router: the block's gate on "
                        "its rows, exact; input-gate: the gate on the layer's input, for the shuffled reduce-scatter)")
    g.add_argument("--smoe-reduce-scatter", choices=REDUCE_SCATTER, default=None,
                   help="speculate: reduce-scatter the attention output's rows already in the token order where "
                        "the decoder layer allows it, half the bytes of vLLM's all-reduce over a network (default "
                        "auto: where the tensor-parallel group spans nodes; on: wherever allowed; off: vLLM's "
                        "all-reduce)")
    g.add_argument("--smoe-stack-order", choices=STACK_ORDERS, default=None,
                   help="speculate on the DeepSeek family, whose decoder layers keep the rows split: an order per "
                        "MoE layer (default layer: the split residual rides in the attention's reduce-scatter) or "
                        "one for the whole step")
    g.add_argument("--smoe-all2all", choices=ALL2ALL, default=None,
                   help="expert-parallel all2all on vLLM's CPU build: smoe's sparse de-duplicated one (default "
                        "there) or vLLM's allgather-reducescatter. On CUDA the transport is vLLM's --all2all-backend "
                        "(speculate needs one that honours token order, e.g. deepep_low_latency) and 'sparse' is "
                        "refused")
    g.add_argument("--smoe-hierarchical", choices=HIERARCHICAL, default=None,
                   help="smoe's sparse all2all where a node holds several expert-parallel ranks: a row crosses to "
                        "another node once and fans out inside it (default auto: where the exchange runs over a "
                        "network; on: wherever a node holds several ranks; off: each row to each rank)")
    g.add_argument("--smoe-dp-routing", choices=["on", "off"], default=None, type=str,
                   help="with --data-parallel-size > 1 and a placement with tables: send each request to the DP "
                        "engine its prompt's tokens score best under the placement (default on), or leave every "
                        "request to vLLM's load balancer (off)")
    g.add_argument("--smoe-auto-replace", choices=["on", "off"], default=None, type=str,
                   help="re-place automatically: when drift holds, build a candidate from the recording "
                        "(--smoe-record) off the serving path and swap it in live when it beats the served "
                        "placement on recent traffic (default off; its settings: additional_config smoe.auto_replace, "
                        "docs/live-replacement.md). Needs VLLM_PLUGINS=smoe (the swap runs in smoe's endpoint plugin)")


def _smoe_from_args(args: argparse.Namespace) -> dict | None:
    given = {key: getattr(args, dest) for dest, key in _FLAGS.items() if getattr(args, dest, None) is not None}
    for key in ("dp_routing", "metrics", "auto_replace"):
        if key in given:
            given[key] = given[key] == "on"
    if "placement_dirs" in given:
        given["placement_dirs"] = [d for d in given["placement_dirs"].split(os.pathsep) if d]
    if getattr(args, "plugin", None) != "smoe":
        if given:
            flags = ", ".join("--" + d.replace("_", "-") for d in _FLAGS if getattr(args, d, None) is not None)
            raise ValueError(f"{flags} given without --plugin smoe")
        return None
    return given


def _install_hooks() -> None:
    from .patches import engine_args

    engine_args.install(_add_flags, _fold_flags, _load_config, _before_engine_config, _after_engine_config)


def _fold_flags(engine_args, args):
    """``EngineArgs.from_cli_args``: the ``--smoe-*`` flags folded into ``additional_config``."""
    with _smoe_errors():
        flags = _smoe_from_args(args)
        if isinstance(engine_args.additional_config, str):  # vLLM keeps what is not a JSON object as text
            if flags is None and "smoe" not in engine_args.additional_config:
                return engine_args  # not smoe's: vLLM names it
            _refuse_additional_config(engine_args.additional_config)
        given = (engine_args.additional_config or {}).get("smoe")
        if given is not None and not isinstance(given, dict):
            raise ValueError(f"--additional-config: field 'smoe' must be a mapping of smoe's settings, got "
                             f"{type(given).__name__}")
    _API_SERVERS[0] = getattr(args, "api_server_count", None)
    if flags is not None:
        extra = dict(engine_args.additional_config or {})
        merged = dict(extra.get("smoe") or {})
        if flags.get("auto_replace") is True and isinstance(merged.get("auto_replace"), dict):
            flags = {k: v for k, v in flags.items() if k != "auto_replace"}  # on: with the settings given there
        merged.update(flags)  # flags win over --additional-config
        extra["smoe"] = merged
        engine_args.additional_config = extra
        # vLLM's extra API servers (DP) rebuild their engine args from this namespace, maybe
        # before smoe's hooks are in place there: hand them the folded config too
        args.additional_config = extra
    return engine_args


def _refuse_additional_config(text: str) -> None:
    """A ``--additional-config`` that is not a JSON object: ValueError saying so in one line."""
    import json

    from ..formats.bounded import short

    try:
        json.loads(text)
        why = "is not a JSON object"
    except (json.JSONDecodeError, RecursionError) as e:
        why = f"is not valid JSON ({getattr(e, 'msg', 'nested too deeply')}, column {getattr(e, 'colno', '?')})"
    raise ValueError(f"--additional-config {why}: {short(text)}")


def _load_config(engine_args, load_config):
    """``EngineArgs.create_load_config``: smoe's loader when a placement or recording is set."""
    from .config import SmoeConfig

    cfg = SmoeConfig.from_additional_config(engine_args.additional_config)
    if cfg is not None and cfg.needs_loader:
        if load_config.load_format not in ("auto", "safetensors", "smoe"):
            raise ValueError(f"smoe needs the default safetensors loader, got --load-format "
                             f"{load_config.load_format!r}")
        load_config.load_format = "smoe"
    return load_config


def _before_engine_config(engine_args):
    """``EngineArgs.create_engine_config``, before vLLM builds its config: smoe's settings (None =
    not asked for), checked."""
    from .config import SmoeConfig

    with _smoe_errors():
        cfg = SmoeConfig.from_additional_config(engine_args.additional_config)
        if cfg is not None:
            from . import patches

            from .patches import interventions

            bad = patches.mismatches(check_all=True)  # every patched symbol, lazily patched ones too
            bad += interventions.mismatches(interventions.modes_of(cfg))  # the changes that replace no symbol
            if bad:
                raise ValueError("smoe was written for another vLLM; these symbols it patches or reads "
                                 "differ here: " + "; ".join(bad))
            for line in interventions.model_mismatches(interventions.modes_of(cfg)):
                logger.warning("smoe: %s; speculate will refuse such a model at load", line)
            cfg.check_files()
            # normalised paths
            engine_args.additional_config = {**engine_args.additional_config, "smoe": cfg.to_dict()}
            _check_engine_args(engine_args, cfg)
    return cfg


def _after_engine_config(engine_args, cfg, vllm_config) -> None:
    """``EngineArgs.create_engine_config``, on the config vLLM built: the placement checked against
    the model, so a bad file stops the process before anything is served."""
    with _smoe_errors():  # smoe's own checks: one line and exit 2 under vllm serve
        if cfg is not None:  # /metrics: where this server's workers publish, before any engine starts
            from .observe.metrics import register_collector, server_metrics_dir

            directory = server_metrics_dir(cfg)
            if directory is not None:
                register_collector(directory)
                line = metrics_start_line(_API_SERVERS[0], os.environ.get("VLLM_PLUGINS"))
                if line and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # vLLM set it up for its API servers
                    from .observe.bridge import start_bridge

                    every = min(1.0, cfg.log_interval / 2)
                    start_bridge(directory, every)
                    logger.info("smoe: %d API servers and VLLM_PLUGINS without smoe (so no smoe endpoint plugin): "
                                "smoe's families reach their /metrics through prometheus_client's multiprocess "
                                "files, refreshed every %.1f s", _API_SERVERS[0], every)
                elif line:
                    logger.warning("%s", line)
        if cfg is not None and cfg.placement is not None:
            pc = vllm_config.parallel_config
            if not pc.worker_extension_cls:  # live re-placement's calls (POST /smoe/placement)
                pc.worker_extension_cls = "vllm_smoe.serving.place.live.SmoeWorkerExtension"
            elif pc.worker_extension_cls != "vllm_smoe.serving.place.live.SmoeWorkerExtension":
                logger.warning("smoe: --worker-extension-cls %s is set, so live re-placement (POST "
                               "/smoe/placement) is off", pc.worker_extension_cls)
        if cfg is not None and cfg.auto_replace is not None:
            from .place.auto import refused

            why = refused(cfg, vllm_config)
            if why:
                raise ValueError(f"field 'auto_replace': the automatic re-placement cannot run on this server: {why}")
        if cfg is not None and cfg.record is not None:
            _recover_at_exit(cfg.record)
        if cfg is not None and cfg.mode == "speculate":
            # smoe's token order sits around vLLM's sequence-parallel MoE, which vLLM turns on
            # only with DP > 1; the flag carries to every worker inside the parallel config
            vllm_config.parallel_config.smoe_sequence_parallel = True
        if cfg is not None:
            from vllm.platforms import current_platform

            from .advice import advice

            for line in advice(vllm_config, cfg, current_platform.device_type):
                logger.warning("smoe: advice: %s", line)
        if cfg is not None and cfg.placement is not None:
            from .place.check import check_served_placement

            served = check_served_placement(cfg.placement, cfg, vllm_config)  # its tables parsed too
            logger.info("smoe: placement %s checked against %s", cfg.placement, vllm_config.model_config.model)
            if cfg.mode == "speculate":  # what the loader sizes the MoE buffers to (moe_buffers)
                from .speculate.moe_buffers import start_line

                line = start_line(vllm_config, served.plan.physical2expert.shape[1])
                if line is not None:
                    logger.info("%s", line)
            pc = vllm_config.parallel_config
            placement = served.placement
            if pc.data_parallel_size > 1 and cfg.dp_routing and not pc.enable_expert_parallel:
                logger.warning("smoe dp routing: off without --enable-expert-parallel (every DP rank holds every "
                               "expert, so no rank is closer to a request's experts)")
            elif pc.data_parallel_size > 1 and cfg.dp_routing and placement.predictor is None:
                logger.warning("smoe dp routing: %s has no predictor tables; every request is left to "
                               "vLLM's load balancer", cfg.placement)


def metrics_start_line(api_servers: int | None, vllm_plugins: str | None) -> str:
    """What to set for smoe's families to reach /metrics ('' = nothing). With several API
    servers vLLM serves /metrics in each from a multiprocess registry it builds itself
    (``get_prometheus_registry``), which no plugin seam reaches; smoe serves its families there
    through its endpoint plugin's /metrics route, and vLLM loads an endpoint plugin only when
    VLLM_PLUGINS names it (deliberately: new routes are new attack surface). api_servers: vllm
    serve's settled --api-server-count (None: not vllm serve); vllm_plugins: VLLM_PLUGINS."""
    if api_servers is None or api_servers <= 1:
        return ""
    named = vllm_plugins is not None and "smoe" in [p.strip() for p in vllm_plugins.split(",")]
    if named:
        return ""
    now = "unset" if vllm_plugins is None else f"{vllm_plugins!r}"
    return (f"smoe: /metrics will carry no smoe: family: {api_servers} API servers serve it (vLLM's default under "
            f"--data-parallel-size), each from a registry vLLM builds itself, which only smoe's endpoint plugin adds "
            f"to, and vLLM loads endpoint plugins only when VLLM_PLUGINS names them (it is {now}). Set "
            f"VLLM_PLUGINS=smoe (a list: it allows vLLM's other plugins too, so name each you use, e.g. "
            f"VLLM_PLUGINS=smoe,other), or serve with --api-server-count 1")


@contextlib.contextmanager
def _smoe_errors():
    """A ValueError from smoe's own checks becomes a :class:`SmoeSettingsError` (still a
    ValueError for ``LLM`` users), which ``vllm serve`` prints as one line, exit code 2."""
    from .config import SmoeSettingsError

    try:
        yield
    except SmoeSettingsError:
        raise
    except ValueError as e:
        raise SmoeSettingsError(str(e)) from None


def _check_engine_args(engine_args, cfg) -> None:
    """What smoe's settings need of vLLM's, before vLLM builds its config: vLLM's routed-experts
    capture and smoe's recorder / token order both take the router's one capture function; the
    sparse manager exists only on CPU; speculate over DeepEP high-throughput at DP = 1 serves
    without CUDA graphs, which vLLM itself decides only for DP > 1 (its kernels cannot be captured)."""
    from vllm.platforms import current_platform

    from .speculate.support import UNCAPTURABLE_BACKENDS

    if getattr(engine_args, "enable_return_routed_experts", False) and (cfg.record or cfg.mode == "speculate"):
        raise ValueError("smoe: --enable-return-routed-experts cannot be combined with --smoe-record or mode "
                         "speculate: both use the router's single capture hook, so one would see nothing; smoe's "
                         "recording writes the same routing (smoe-trace)")
    if current_platform.is_cpu():
        return
    if cfg.all2all == "sparse":
        raise ValueError(f"smoe: --smoe-all2all sparse (field 'all2all') runs on vLLM's CPU build only; on "
                         f"{current_platform.device_type} choose vLLM's --all2all-backend instead")
    backend = getattr(engine_args, "all2all_backend", None)
    if cfg.mode == "speculate" and backend in UNCAPTURABLE_BACKENDS and engine_args.data_parallel_size == 1:
        from vllm.config.compilation import CUDAGraphMode

        cc = engine_args.compilation_config
        if cc.cudagraph_mode is not None and cc.cudagraph_mode != CUDAGraphMode.NONE:
            logger.warning("smoe mode speculate: CUDA graphs off: --all2all-backend %s cannot be captured (vLLM "
                           "turns them off for it with DP > 1 only)", backend)
        cc.cudagraph_mode = CUDAGraphMode.NONE


_recovering: set[str] = set()


def _recover_at_exit(record_dir: str) -> None:
    """vLLM stops its engine and workers with a signal and, at its default shutdown timeout of
    0 s, kills them at once, so a recorder there may never close its file. The process that
    started them (``vllm serve``, or the ``LLM`` user's) outlives them: at its exit it turns the
    spill data they left into traces."""
    if record_dir in _recovering:
        return
    _recovering.add(record_dir)
    import atexit

    atexit.register(_recover_spills, record_dir)


def _recover_spills(record_dir: str, wait_s: float = 10.0) -> None:
    from ..formats.trace import recover_dead_spills

    if not os.path.isdir(record_dir):
        return  # nothing was recorded
    try:
        done = recover_dead_spills(record_dir, wait_s)
    except ValueError as e:
        logger.warning("smoe record: %s", e)
        return
    for spill, out, n, error in done:
        if error:
            logger.warning("smoe record: %s", error)
        else:
            logger.info("smoe record: wrote %s at shutdown (the worker was stopped before closing it): %d tokens",
                        out or spill, n)


def register() -> None:
    """Idempotent; touches no accelerator; smoe stays inactive unless its settings are given."""
    global _done
    if _done:
        return
    _done = True
    _install_hooks()
    from .patches import cli

    cli.install()
    from .patches import cpu

    cpu.at_start()
    from .place.loader import register_loader

    register_loader()
    # vLLM's API servers (DP spawns several) build their engine clients from a config they are
    # handed, without create_engine_config: the balancer is wrapped here, and a client whose
    # config does not ask for smoe's routing keeps vLLM's choice untouched
    from .dp.router import install as install_dp_router

    install_dp_router()
