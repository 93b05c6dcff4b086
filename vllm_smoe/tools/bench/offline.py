"""``smoe-bench ilp``, ``place-scale``, ``predictors``: the offline side (no vLLM)."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from .common import write_json


def run_ilp(a) -> int:
    from ...placement.counts import layer_counts
    from ...placement.ilp import solve_ilp
    from ...placement.layout import SOLVERS
    from ...testbed.synthetic import MoEShape, generate

    if a.objective == "bytes":
        return run_ilp_bytes(a)
    methods = ("coclust", "alternating", "ceo", "metis", "round_robin", "linear")
    gaps = {m: [] for m in methods}
    print(f"instances: {a.instances} x (vocab {a.vocab}, {a.experts} experts, top-{a.top_k}, {a.tokens} tokens, "
          f"ep {a.ep_size}), capacity {a.capacity}, expert-load cap {a.max_expert_load}")
    for seed in range(a.instances):
        ch = next(generate(MoEShape(1, a.experts, a.top_k, a.vocab, 64), a.tokens, seed=seed, hotness=a.hotness,
                           token_zipf=0.8))
        ids, A, occ = layer_counts(ch["token_ids"], ch["topk_ids"][:, 0], a.experts)
        t0 = time.perf_counter()
        opt, _, _, proven = solve_ilp(A.toarray(), occ, a.ep_size, a.capacity, max_expert_load=a.max_expert_load,
                                      time_limit=a.time_limit)
        secs = time.perf_counter() - t0
        row = []
        for m in methods:
            if m == "coclust":
                from ...placement.coclust import place_coclust

                e2r = place_coclust(A, occ, a.ep_size, capacity=a.capacity, seed=seed,
                                    max_expert_load=a.max_expert_load or np.inf)
            else:
                e2r = SOLVERS[m](A, occ, a.ep_size, a.capacity, 0.5, seed)
            val, *_ = solve_ilp(A.toarray(), occ, a.ep_size, a.capacity, fixed_expert2rank=e2r,
                                max_expert_load=a.max_expert_load, time_limit=a.time_limit)
            gaps[m].append(1.0 - val / opt)  # NaN-free: a method breaking the load cap is infeasible
            row.append(f"{m} {100 * gaps[m][-1]:5.1f}%")
        print(f"seed {seed}: ILP {opt:.0f} ({'optimal' if proven else 'time limit'}, {secs:.1f} s); gaps: "
              + ", ".join(row))
    print("mean gap to the ILP bound: " + ", ".join(f"{m} {100 * np.mean(g):.2f}%" for m, g in gaps.items()))
    print("max gap: " + ", ".join(f"{m} {100 * np.max(g):.2f}%" for m, g in gaps.items()))
    return 0


def run_ilp_bytes(a) -> int:
    """Every method's de-duplicated remote rows (tokens by the capped best-rank rule) against the
    exact optimum of the bytes program, on small synthetic instances."""
    from ...placement.bytes import layer_instances, remote_bytes
    from ...placement.counts import assign_token_ids, layer_counts, rank_scores
    from ...placement.ilp import solve_ilp_bytes
    from ...placement.layout import NEEDS_INSTANCES, SOLVERS
    from ...testbed.synthetic import MoEShape, generate

    methods = ("bytes", "coclust", "alternating", "ceo", "metis", "round_robin", "linear")
    mel = a.max_expert_load or 1.10
    gaps: dict[str, list[float]] = {m: [] for m in methods}
    loads: dict[str, list[float]] = {m: [] for m in methods}
    print(f"instances: {a.instances} x (vocab {a.vocab}, {a.experts} experts, top-{a.top_k}, {a.tokens} tokens, "
          f"ep {a.ep_size}), capacity {a.capacity}, expert-load cap {mel} (bytes program and coclust/bytes)")
    for seed in range(a.instances):
        ch = next(generate(MoEShape(1, a.experts, a.top_k, a.vocab, 64), a.tokens, seed=seed, hotness=a.hotness,
                           token_zipf=0.8))
        tok, topk = ch["token_ids"], ch["topk_ids"][:, 0]
        ids, A, occ = layer_counts(tok, topk, a.experts)
        inst = layer_instances(np.searchsorted(ids, tok), topk)
        t0 = time.perf_counter()
        opt, _, _, proven = solve_ilp_bytes(A.toarray(), occ, inst, a.ep_size, a.capacity, mel, a.time_limit)
        secs = time.perf_counter() - t0
        load = np.asarray(A.sum(axis=0)).ravel()
        row = []
        for m in methods:
            kw = {"inst": inst} if m in NEEDS_INSTANCES else {}
            e2r = SOLVERS[m](A, occ, a.ep_size, a.capacity, 0.5, seed, mel, **kw)
            got = remote_bytes(inst[1], inst[2], inst[0], e2r,
                               assign_token_ids(rank_scores(A, e2r, a.ep_size), occ, a.capacity))
            rl = np.bincount(e2r, weights=load, minlength=a.ep_size)
            gaps[m].append(got / opt - 1.0)
            loads[m].append(rl.max() / rl.mean())
            row.append(f"{m} {100 * gaps[m][-1]:+5.1f}% (load {loads[m][-1]:.2f})")
        print(f"seed {seed}: ILP {opt:.0f} rows ({'optimal' if proven else 'time limit'}, {secs:.1f} s); "
              + ", ".join(row))
    print("mean excess rows over the optimum: " + ", ".join(
        f"{m} {100 * np.mean(g):.2f}% (load {np.mean(loads[m]):.2f})" for m, g in gaps.items()))
    return 0


def _tree_memory(pid: int) -> tuple[int, int]:
    """(sum of proportional set sizes, largest resident set) of ``pid`` and its descendants, bytes
    (Linux /proc; PSS shares copy-on-write pages between forked workers instead of counting them twice)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    pss = rss = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
                    elif line.startswith("Rss:"):
                        rss = max(rss, int(line.split()[1]) * 1024)
        except OSError:
            continue
    return pss, rss


def _measure_command(cmd: list[str], interval: float = 0.5) -> dict:
    import subprocess

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_pss = peak_rss = 0
    while proc.poll() is None:
        pss, rss = _tree_memory(proc.pid)
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        time.sleep(interval)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err[-2000:]}")
    return {"command": " ".join(cmd), "wall_s": round(wall, 1), "peak_pss_mb": round(peak_pss / 2**20),
            "peak_rss_one_process_mb": round(peak_rss / 2**20), "stdout": out.strip().splitlines()[-1:],
            "log": [x for x in err.replace("\r", "\n").splitlines() if x.startswith(("counted", "wrote", "evaluating"))]}


def run_place_scale(a) -> int:
    """Build (and evaluate) a placement from each trace spec, measuring time and memory."""
    import tempfile

    from ...formats.trace import open_traces

    results = []
    for spec in a.trace:
        _, traces = open_traces([spec])
        tokens = sum(t.num_tokens for t in traces)
        with tempfile.TemporaryDirectory() as d:
            yaml_path = os.path.join(d, "p.yaml")
            base = [sys.executable, "-m", "vllm_smoe.tools.place"]
            jobs = ["--jobs", str(a.jobs)] if a.jobs else []
            row = {"trace": spec, "tokens": tokens, "files": len(traces), "ep_size": a.ep_size,
                   "build": _measure_command(base + ["build", "--trace", spec, "--ep-size", str(a.ep_size), "-o",
                                                     yaml_path] + jobs)}
            if a.evaluate:
                row["evaluate"] = _measure_command(base + ["evaluate", "--trace", spec, "--placement", yaml_path] + jobs)
        results.append(row)
        for what in ("build", "evaluate"):
            if what in row:
                r = row[what]
                print(f"{spec}: {tokens} tokens, {what}: {r['wall_s']} s, peak {r['peak_pss_mb']} MiB PSS over all "
                      f"processes (largest process {r['peak_rss_one_process_mb']} MiB RSS)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": f"{os.cpu_count()} cores", "results": results}, f, indent=2)
    return 0


def run_predictors(a) -> int:
    """Each predictor's share of the capped oracle, in domain and on every domain left out of
    training: placement and tables built with smoe-place on the training trace (without the
    domain), scored on the held-out trace (that domain only)."""
    import tempfile

    from ..place import main as smoe_place
    from ..cli_util import check_output_file
    from ...placement.online import PREDICTORS as SIM
    from ...testbed import FIXTURE_MODEL, FIXTURE_TRACES
    from ...formats.trace import read_traces, write_trace

    if a.json:
        check_output_file(a.json, "--json")
    train, held = a.train or FIXTURE_TRACES["train"], a.heldout or FIXTURE_TRACES["heldout"]
    model = a.model if a.model is not None else (FIXTURE_MODEL if a.train is None else None)
    fields = ("token_ids", "request_ids", "positions", "topk_ids", "step_ids", "is_prefill", "domain")
    meta, tr, _ = read_traces([train], fields)
    hmeta, he, _ = read_traces([held], fields)
    for name, arr, m in ((train, tr, meta), (held, he, hmeta)):
        if "domain" not in arr or not m.domains:
            raise ValueError(f"{name}: needs the 'domain' field and meta.domains to leave a domain out")
    if hmeta.domains != meta.domains:  # a domain is an index into its file's list
        raise ValueError(f"{held}: field 'meta.domains' = {list(hmeta.domains)} differs from {train}'s "
                         f"{list(meta.domains)}")

    def place(*args):
        if smoe_place(list(args)) != 0:
            raise ValueError(f"smoe-bench predictors: smoe-place {' '.join(args)} failed (its error above)")
    splits = [("in-domain", None)] + [(f"without {d}", i) for i, d in enumerate(meta.domains)]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for ep in a.ep_size:
            for label, d in splits:
                if d is not None and not ((tr["domain"] != d).any() and (he["domain"] == d).any()):
                    raise ValueError(f"{train if (tr['domain'] == d).all() else held}: leaving out domain "
                                     f"{meta.domains[d]!r} leaves no training or no held-out rows")
                pair = []
                for arr, keep in ((tr, None if d is None else tr["domain"] != d),
                                  (he, None if d is None else he["domain"] == d)):
                    path = os.path.join(work, f"{len(pair)}.npz")
                    write_trace(path, meta, **{k: v if keep is None else v[keep] for k, v in arr.items()})
                    pair.append(path)
                yaml_path = os.path.join(work, "p.yaml")
                build = ["build", "--trace", pair[0], "--ep-size", str(ep), "-o", yaml_path]
                place(*build, "--learned", *(["--model", model] if model else []))
                # the same placement without the bigram table: what the pairs add to the token table
                unigram = os.path.join(work, "u.yaml")
                place(*build[:-1], unigram, "--bigram-pairs", "0", *(["--model", model] if model else []))
                row = {"ep_size": ep, "split": label,
                       "test_tokens": int(he["token_ids"].size if d is None else (he["domain"] == d).sum())}
                for name, placement, pred in [(p, yaml_path, p) for p in SIM] + [("tables-unigram", unigram, "tables")]:
                    out = os.path.join(work, f"{name}.json")
                    place("evaluate", "--trace", pair[1], "--placement", placement, "--predictor", pred, "--json", out)
                    m = next(iter(json.load(open(out)).values()))
                    row[name] = {k: m[k] for k in ("lar", "oracle_lar", "oracle_share", "a2a_bytes_per_token")}
                rows.append(row)
                print(f"EP {ep} {label:>16}: oracle LAR {row['router']['lar']:.3f}; " + ", ".join(
                    f"{p} {row[p]['lar']:.3f} ({row[p]['oracle_share']:.3f})" for p in row
                    if isinstance(row[p], dict) and p != "router"), flush=True)
    if a.json:
        write_json(a.json, {"train": train, "heldout": held, "model": model, "rows": rows})
    return 0


def run_migrate(a) -> int:
    """``smoe-place advise --max-moves F`` after a workload shift: the served placement built on
    some workloads of the training trace, the recording those it never saw (their training rows,
    then their held-out rows, one recording: advise trains on the first half of its 512-token
    batches, three quarters of the training rows, and judges on the rest); per EP
    size and share F, LAR and rows per token of the served placement (its old tables), the fresh
    candidate and the limited ones, the slots each moves and the share of the gain kept."""
    import tempfile

    from ..place import main as smoe_place
    from ..cli_util import check_output_file
    from ...formats.trace import read_traces, write_trace
    from ...placement.migrate import BALANCE_WEIGHT
    from ...testbed import FIXTURE_TRACES

    if a.json:
        check_output_file(a.json, "--json")
    fields = ("token_ids", "request_ids", "positions", "topk_ids", "is_prefill", "domain")
    meta, tr, _ = read_traces([a.train or FIXTURE_TRACES["train"]], fields)
    _, he, _ = read_traces([a.heldout or FIXTURE_TRACES["heldout"]], fields)
    if "domain" not in tr or not meta.domains:
        raise ValueError("smoe-bench migrate: the traces need the 'domain' field and meta.domains")
    D = len(meta.domains)
    shifts = [(tuple(range(D // 2)), tuple(range(D // 2, D))), (tuple(range(D // 2, D)), tuple(range(D // 2)))]

    def place(*args):
        if smoe_place([str(x) for x in args]) != 0:
            raise ValueError(f"smoe-bench migrate: smoe-place {' '.join(map(str, args))} failed (its error above)")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for ep in a.ep_size:
            for old, new in shifts:
                name = f"{'+'.join(meta.domains[d] for d in old)} -> {'+'.join(meta.domains[d] for d in new)}"
                served = os.path.join(work, "served.yaml")
                path = os.path.join(work, "old.npz")
                keep = np.isin(tr["domain"], old)
                write_trace(path, meta, **{k: v[keep] for k, v in tr.items()})
                # --mode dp: the trace holds one workload after another; the router meets them mixed
                place("build", "--trace", path, "--ep-size", ep, "-o", served,
                      *(["--mode", "dp", "--shuffle-requests", 0] if a.mode == "dp" else []))
                recording = []
                for i, arr in enumerate((tr, he)):  # no step ids: halves of the two files' 512-token batches
                    keep = np.isin(arr["domain"], new)
                    recording.append(os.path.join(work, f"rec{i}.npz"))
                    write_trace(recording[-1], meta, **{k: v[keep] for k, v in arr.items()})
                if a.mode == "dp":  # no live swaps under DP: the fresh candidate alone
                    out = os.path.join(work, "advise.json")
                    place("advise", "--trace", *recording, "--placement", served, "--max-tokens", 0, "--json", out)
                    cur, fresh = json.load(open(out)).values()
                    row = {"ep_size": ep, "shift": name, "mode": "dp", "served": _migrate_row(cur, dp=True),
                           "fresh": _migrate_row(fresh, dp=True)}
                    rows.append(row)
                    print(f"EP {ep} {name} (--mode dp): " + "; ".join(
                        f"{k} LAR {r['lar']:.3f}, rows {r['remote_unique_per_token']:.3f}, expert load "
                        f"{r['expert_load']:.2f}, step imbalance {r['step_imbalance']:.3f}"
                        for k, r in (("served", row["served"]), ("fresh", row["fresh"]))), flush=True)
                    continue
                for weight in a.balance_weight or [None]:
                    row = {"ep_size": ep, "shift": name, "limited": {},
                           "balance_weight": BALANCE_WEIGHT if weight is None else weight}
                    for share in a.max_moves:
                        out = os.path.join(work, "advise.json")
                        place("advise", "--trace", *recording, "--placement", served, "--max-moves", share,
                              "--max-tokens", 0, "--json", out,
                              *(["--balance-weight", weight] if weight is not None else []))
                        res = json.load(open(out))
                        cur, fresh, lim = (res[k] for k in res)
                        row["served"], row["fresh"] = _migrate_row(cur), _migrate_row(fresh)
                        gain = fresh["lar"] - cur["lar"]
                        row["limited"][f"{share:g}"] = {
                            **_migrate_row(lim), "gain_kept": (lim["lar"] - cur["lar"]) / gain if gain > 0 else None}
                    rows.append(row)
                    print(f"EP {ep} {name} (balance weight {row['balance_weight']:g}): LAR served "
                          f"{row['served']['lar']:.3f}, fresh {row['fresh']['lar']:.3f} ({row['fresh']['moved_slots']} "
                          f"slots, load {row['fresh']['train_expert_load']:.2f}); " + ", ".join(
                              f"F={f} {r['lar']:.3f} ({r['moved_slots']} slots, kept "
                              f"{'-' if r['gain_kept'] is None else format(r['gain_kept'], '.0%')}, load "
                              f"{r['train_expert_load']:.2f})" for f, r in row["limited"].items()), flush=True)
    if a.json:
        write_json(a.json, {"train": a.train or FIXTURE_TRACES["train"], "heldout": a.heldout or
                            FIXTURE_TRACES["heldout"], "mode": a.mode, "rows": rows,
                            **({"max_moves": a.max_moves} if a.mode == "tp" else {})})
    return 0


def _migrate_row(m: dict, dp: bool = False) -> dict:
    """One placement's held-out metrics, its slots moved and its expert load on advise's training
    half (--mode dp: its step imbalance instead; no moves are limited there)."""
    return {k: m[k] for k in ("lar", "remote_unique_per_token", "expert_load", "moved_slots") + (
        ("step_imbalance",) if dp else ("train_expert_load",))}
