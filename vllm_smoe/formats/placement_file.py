"""The YAML placement file (schema ``smoe_placement: 1``): write atomically, read and validate.

The file's fields, by example: :class:`Placement`. Every error names the file and the field.
Nothing here imports torch or vLLM."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np

from .bounded import short
from ..placement.groups import broken_group
from ..placement.counts import rank_sizes

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Placement:
    """A placement file, read and validated. The YAML it comes from:

    ```yaml
    smoe_placement: 1
    model: {num_layers: 4, num_experts: 32, top_k: 4, vocab_size: 4096, fingerprint: 1f2e...}
                                  # + groups: G when built for grouped top-k routing (n_group)
    ep_size: 4
    nodes: 1
    capacity: 1.1
    method: coclust
    layers:                       # one entry per MoE layer, in order
      - expert_to_rank: [0, 3, 1, ...]     # [E] home rank of each expert (also read as expert2rank)
        replicas: [[7, 2], ...]            # optional extra copies: [expert, rank]
    predictor: placement.1928c4ef4627.tables.npz   # tables, relative to this file, named by content
    predictor_sha256: 1928c4ef4627...      # sha256 of that file: a YAML and tables always belong together
    built_from: {traces: [...], tokens: 131072}
    metrics: {lar: 0.44, ...}              # on the training trace
    ```
    """

    path: str
    ep_size: int
    nodes: int
    num_layers: int
    num_experts: int
    top_k: int
    vocab_size: int | None
    fingerprint: str | None
    expert2rank: np.ndarray  # [L, E] int32 home rank of each expert
    replicas: np.ndarray  # [L, R, 2] int32 (expert, rank) extra copies, -1 = none
    predictor: str | None  # absolute path of the tables .npz
    method: str
    capacity: float
    metrics: dict = field(default_factory=dict)
    predictor_sha256: str | None = None  # content hash of the tables file the YAML was written with
    groups: int = 1  # routing groups (grouped top-k) every layer keeps whole

    def holds(self) -> np.ndarray:
        """[L, N, E] bool: rank holds a copy of expert."""
        from ..placement.metrics import holds_from_expert2rank

        return holds_from_expert2rank(self.expert2rank, self.ep_size, self.replicas)


def model_fingerprint(config: dict) -> str:
    """Stable id of a model's routing-relevant shape: sha256 over the fields that decide
    which expert ids exist where (16 hex digits); a composite (vision-language) config's are
    read in its language model's config, beside its own ``model_type``."""
    from .model_info import text_config

    text = text_config(config)
    if text is not config and isinstance(text, dict):
        config = {**text, "model_type": config.get("model_type")}
    keys = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "num_experts", "num_local_experts",
            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace",
            "decoder_sparse_step", "mlp_only_layers", "n_group", "topk_group")
    sub = {k: config[k] for k in keys if k in config}
    return hashlib.sha256(json.dumps(sub, sort_keys=True).encode()).hexdigest()[:16]


def _atomic_write(path: str, data: bytes) -> None:
    from .bounded import refuse_special

    refuse_special(path, "output")
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _npz_bytes(**arrays: np.ndarray) -> bytes:
    """An ``.npz`` (what ``np.load`` reads) deflated at level 1: tables of large vocabularies
    compress about as well as at savez_compressed's level 6, in a fifth of the time."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for name, a in arrays.items():
            with zf.open(name + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(a), allow_pickle=False)
    return buf.getvalue()


def _no_aliases_dumper():
    import yaml

    class NoAliases(yaml.SafeDumper):  # plain text for other YAML tools and diffs
        def ignore_aliases(self, data):
            return True
    return NoAliases


def write_placement(path: str, *, expert2rank: np.ndarray, ep_size: int, nodes: int, top_k: int,
                    vocab_size: int | None, method: str, capacity: float, tables: dict[str, np.ndarray] | None,
                    replicas: np.ndarray | None = None, fingerprint: str | None = None,
                    built_from: dict | None = None, metrics: dict | None = None, groups: int = 1,
                    read_back: bool = True) -> str:
    """Write the YAML (and its tables ``<stem>.<sha256[:12]>.tables.npz`` beside it), each
    atomically. The tables land first, under a name of their own content, and the YAML records
    their hash; the tables the previous YAML named are removed only after the new YAML is in
    place. So an interrupted build leaves the old pair intact, two concurrent builds leave
    whichever YAML landed last with its own tables, and no reader ever gets a mixed pair. With
    ``read_back`` (always, but in tests that write a bad file on purpose) the pair is first read
    as every reader will: a ValueError names what would be refused, and nothing is written."""

    import yaml

    L, E = expert2rank.shape
    stem = os.path.splitext(os.path.basename(path))[0]
    data = sha = tables_name = None
    if tables is not None:
        data = _npz_bytes(expert2rank=expert2rank.astype(np.int32), **tables)
        sha = hashlib.sha256(data).hexdigest()
        tables_name = f"{stem}.{sha[:12]}.tables.npz"
    layers = []
    for layer in range(L):
        entry: dict = {"expert_to_rank": [int(x) for x in expert2rank[layer]]}
        if replicas is not None:
            rep = replicas[layer]
            rep = rep[rep[:, 0] >= 0]
            if rep.size:
                entry["replicas"] = [[int(e), int(r)] for e, r in rep]
        layers.append(entry)
    model = {"num_layers": int(L), "num_experts": int(E), "top_k": int(top_k)}
    if vocab_size is not None:
        model["vocab_size"] = int(vocab_size)
    if fingerprint:
        model["fingerprint"] = fingerprint
    if groups > 1:
        model["groups"] = int(groups)
    doc = {
        "smoe_placement": SCHEMA_VERSION,
        "model": model,
        "ep_size": int(ep_size),
        "nodes": int(nodes),
        "capacity": float(capacity),
        "method": method,
        "layers": layers,
        "predictor": tables_name,
        **({"predictor_sha256": sha} if sha else {}),
        "built_from": built_from or {},
        "metrics": {k: (round(float(v), 6) if isinstance(v, (float, np.floating)) else v)
                    for k, v in (metrics or {}).items() if not isinstance(v, (list, dict))},
    }
    text = yaml.dump(doc, Dumper=_no_aliases_dumper(), sort_keys=False, default_flow_style=None, width=120).encode()
    try:  # read back as every reader will: nothing is written that a server or validate would refuse
        if read_back:
            written = load_placement(path, data=text)
            if data is not None:
                load_tables(written, data)
    except ValueError as e:
        raise ValueError(f"{path}: not written: what was built does not read back: {e}") from None
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    previous = _tables_named_by(path, stem)
    if data is not None:
        _atomic_write(os.path.join(parent, tables_name), data)
    try:
        _atomic_write(path, text)
    except BaseException:
        if data is not None and tables_name != previous:  # no YAML names the new tables: no orphan
            try:
                os.remove(os.path.join(parent, tables_name))
            except FileNotFoundError:
                pass
        raise
    if previous is not None and previous != tables_name:
        try:
            os.remove(os.path.join(parent, previous))
        except FileNotFoundError:
            pass  # a concurrent build of the same output removed it first
    return path


def _tables_named_by(path: str, stem: str) -> str | None:
    """The tables file an existing YAML at ``path`` names, if it looks like one this module
    wrote for it (``<stem>.*tables.npz`` beside it): the one to remove once replaced."""
    from .bounded import load_yaml

    try:
        doc = load_yaml(path, "existing output")
    except ValueError:
        return None
    import re

    name = doc.get("predictor") if isinstance(doc, dict) else None
    if not isinstance(name, str) or not re.fullmatch(re.escape(stem) + r"\.([0-9a-f]{12}\.)?tables\.npz", name):
        return None
    parent = os.path.dirname(os.path.abspath(path))
    for other in os.listdir(parent):  # a copy of the YAML (a backup, a second name) keeps its tables
        if other.endswith((".yaml", ".yml")) and other != os.path.basename(path):
            try:
                with open(os.path.join(parent, other), errors="replace") as f:
                    if name in f.read():
                        return None
            except OSError:
                return None
    return name


def _int(doc: dict, key: str, where: str, minimum: int = 1) -> int:
    v = doc.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"{where}: field '{key}' must be an integer >= {minimum}, got {short(v)}")
    return v


def load_placement(path: str, data: bytes | None = None) -> Placement:
    """Read and validate a placement YAML. Raises ValueError naming the file and the field.
    ``data``: the YAML's bytes as read before (:class:`Snapshot`); the file is then not opened
    and its tables file not looked for (the snapshot holds its bytes)."""
    from .bounded import load_yaml

    doc = load_yaml(path, "placement file", data=data)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: top level must be a mapping, got {type(doc).__name__}")
    ver = doc.get("smoe_placement")
    if ver != SCHEMA_VERSION:
        raise ValueError(f"{path}: field 'smoe_placement' must be {SCHEMA_VERSION} (schema version), got {short(ver)}")
    model = doc.get("model")
    if not isinstance(model, dict):
        raise ValueError(f"{path}: field 'model' must be a mapping with num_layers, num_experts, top_k")
    L = _int(model, "num_layers", f"{path}: model")
    E = _int(model, "num_experts", f"{path}: model")
    K = _int(model, "top_k", f"{path}: model")
    vocab = model.get("vocab_size")
    N = _int(doc, "ep_size", path)
    nodes = _int(doc, "nodes", path) if "nodes" in doc else 1
    groups = _int(model, "groups", f"{path}: model") if "groups" in model else 1
    if E % groups:
        raise ValueError(f"{path}: field 'model.groups' = {groups} does not divide model.num_experts = {E}")
    if not 1 <= N <= E:
        raise ValueError(f"{path}: field 'ep_size' = {N} must be in 1..model.num_experts ({E})")
    sizes = rank_sizes(E, N)  # vLLM's split: E / N each, or the first E mod N ranks one more
    if E % N and (nodes > 1 or groups > 1):
        raise ValueError(f"{path}: field 'ep_size' = {N} does not divide model.num_experts = {E}, which is "
                         f"supported only without nodes and routing groups (field "
                         f"{'nodes' if nodes > 1 else 'model.groups'} = {nodes if nodes > 1 else groups})")
    if N % nodes:
        raise ValueError(f"{path}: field 'nodes' = {nodes} does not divide ep_size = {N}")
    layers = doc.get("layers")
    if not isinstance(layers, list) or len(layers) != L:
        n = len(layers) if isinstance(layers, list) else layers
        raise ValueError(f"{path}: field 'layers' must list {L} entries (model.num_layers), got {short(n)}")
    e2r = np.empty((L, E), dtype=np.int32)
    reps = []
    for i, entry in enumerate(layers):
        # the map's name in code and docs is expert2rank; files written so far spell it
        # expert_to_rank: either is read, one per layer
        keys = [k for k in ("expert2rank", "expert_to_rank") if isinstance(entry, dict) and k in entry]
        key = keys[0] if keys else "expert2rank"
        where = f"{path}: field 'layers[{i}].{key}'"
        if len(keys) > 1:
            raise ValueError(f"{path}: field 'layers[{i}]' gives both expert2rank and expert_to_rank; keep one")
        if not isinstance(entry, dict) or not isinstance(entry.get(key), list):
            raise ValueError(f"{where} is missing (a list of each expert's home rank)")
        row = entry[key]
        if len(row) != E:
            raise ValueError(f"{where} must hold {E} integers (model.num_experts), got {len(row)} entries")
        odd = [x for x in row if not isinstance(x, int) or isinstance(x, bool)]
        if odd:
            raise ValueError(f"{where} must hold integer ranks, got {short(odd[0])}")
        arr = np.asarray(row, dtype=np.int64)
        bad = np.flatnonzero((arr < 0) | (arr >= N))
        if bad.size:
            raise ValueError(f"{where}: expert {bad[0]} on rank {arr[bad[0]]}, outside [0, ep_size={N})")
        per = np.bincount(arr, minlength=N)
        if (per != sizes).any():
            r = int(np.flatnonzero(per != sizes)[0])
            raise ValueError(f"{where}: rank {r} holds {per[r]} experts, it must hold {sizes[r]} "
                             + (f"(every rank {E // N})" if E % N == 0 else
                                f"(vLLM's split of {E} over {N}: {E // N + 1} on rank"
                                + (f"s 0..{E % N - 1}" if E % N > 1 else " 0") + f", {E // N} on the others)"))
        if groups > 1 and broken_group(arr, groups) >= 0:
            raise ValueError(f"{where}: expert {broken_group(arr, groups)}'s routing group is split "
                             f"(model.groups = {groups}: a rank holds whole groups, or a block of ranks one group)")
        e2r[i] = arr
        rep = entry.get("replicas", [])
        if not isinstance(rep, list) or not all(isinstance(p, list) and len(p) == 2 for p in rep):
            raise ValueError(f"{path}: field 'layers[{i}].replicas' must be a list of [expert, rank] pairs")
        if not all(isinstance(x, int) and not isinstance(x, bool) for p in rep for x in p):
            raise ValueError(f"{path}: field 'layers[{i}].replicas' must hold integer [expert, rank] pairs")
        rep = np.asarray(rep, dtype=np.int64).reshape(-1, 2)
        if rep.size and ((rep[:, 0] < 0) | (rep[:, 0] >= E) | (rep[:, 1] < 0) | (rep[:, 1] >= N)).any():
            raise ValueError(f"{path}: field 'layers[{i}].replicas' names an expert >= {E} or a rank >= {N}")
        if rep.size and (arr[rep[:, 0]] == rep[:, 1]).any():
            e = int(rep[arr[rep[:, 0]] == rep[:, 1]][0, 0])
            raise ValueError(f"{path}: field 'layers[{i}].replicas': expert {e} copied to its own home rank")
        if rep.size and E % N:
            raise ValueError(f"{path}: field 'layers[{i}].replicas': copies need ep_size to divide "
                             f"model.num_experts ({N} does not divide {E})")
        if rep.size and np.unique(rep, axis=0).shape[0] != rep.shape[0]:
            raise ValueError(f"{path}: field 'layers[{i}].replicas' lists an (expert, rank) pair twice")
        reps.append(rep)
    R = max((r.shape[0] for r in reps), default=0)
    replicas = np.full((L, R, 2), -1, dtype=np.int32)
    for i, r in enumerate(reps):
        replicas[i, : r.shape[0]] = r
    pred = doc.get("predictor")
    pred_path = None
    if pred is not None:
        if not isinstance(pred, str):
            raise ValueError(f"{path}: field 'predictor' must be a file name, got {short(pred)}")
        pred_path = os.path.join(os.path.dirname(os.path.abspath(path)), pred)
        if data is None and not os.path.isfile(pred_path):
            raise ValueError(f"{path}: field 'predictor': tables file {pred_path} not found")
    sha = doc.get("predictor_sha256")
    if sha is not None and (not isinstance(sha, str) or len(sha) != 64):
        raise ValueError(f"{path}: field 'predictor_sha256' must be a 64-digit hex string, got {short(sha)}")
    cap = doc.get("capacity", 1.10)
    if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not 1.0 <= cap < float("inf"):
        raise ValueError(f"{path}: field 'capacity' must be a finite number >= 1.0, got {short(cap)}")
    return Placement(path=path, ep_size=N, nodes=nodes, num_layers=L, num_experts=E, top_k=K,
                     vocab_size=vocab, fingerprint=model.get("fingerprint"), expert2rank=e2r, replicas=replicas,
                     predictor=pred_path, method=str(doc.get("method", "unknown")), capacity=float(cap),
                     metrics=doc.get("metrics") or {}, predictor_sha256=sha, groups=groups)


def _tables_bound(placement: Placement) -> int:
    """Bytes the tables of this placement can hold, decompressed: [L, V] rows of a few int and
    float columns (V: the model's vocabulary, 2^19 when the YAML does not say), bigrams, and a
    learned predictor of width D <= placement.learned.MAX_WIDTH ([2V + 1, D] rows and
    [D, L * N] weights)."""
    from ..placement.learned import MAX_WIDTH

    V = max(placement.vocab_size or (1 << 19), placement.num_experts)
    learned = (2 * V + 2 + placement.num_layers * placement.ep_size) * MAX_WIDTH * 4
    return placement.num_layers * V * 256 + learned + (64 << 20)


@dataclass(frozen=True)
class Snapshot:
    """A placement as read once: the YAML's bytes and its tables file's (None = it names none).
    Every process that parses a snapshot parses the same placement, whatever the files on disk
    do meanwhile (a live swap ships one to every worker)."""

    path: str  # the YAML's resolved path, for messages
    yaml: bytes
    tables: bytes | None

    @property
    def sha256(self) -> str:
        h = hashlib.sha256(self.yaml)
        if self.tables is not None:
            h.update(self.tables)
        return h.hexdigest()

    def placement(self) -> Placement:
        return load_placement(self.path, self.yaml)


def yaml_bound(like: Placement) -> int:
    """Bytes a placement YAML of ``like``'s shape (its layers, experts and ranks) can need: 16 per
    value of its layers (each expert's home rank, and a copy of each expert on every other rank
    as two values; 16 bytes covers block style with deep indentation), plus 256 KiB for the rest
    (model, metrics, built_from, comments). Checked before parsing, which costs about 10 µs and
    150 bytes of memory per byte of YAML."""
    from .bounded import MAX_YAML_BYTES

    L, E, N = like.num_layers, like.num_experts, like.ep_size
    return min(MAX_YAML_BYTES, (256 << 10) + L * E * (1 + 2 * (N - 1)) * 16)


def read_snapshot(path: str, allowed_dirs: tuple[str, ...] | None = None, like: Placement | None = None) -> Snapshot:
    """Resolve ``path`` (symlinks too), refuse it unless it and its tables file lie inside one of
    ``allowed_dirs`` (None = anywhere), and read both once: a :class:`Snapshot`. ``like``: a
    placement of the same model (the served one): a YAML larger than one of its shape can need
    (:func:`yaml_bound`) is refused before it is read. ValueError names the file; contents are
    never echoed."""
    from .bounded import MAX_YAML_BYTES, read_bytes, regular_file

    real = os.path.realpath(path)

    def inside(p: str, what: str) -> None:
        if allowed_dirs is not None and not any(os.path.commonpath([p, d]) == d
                                                for d in map(os.path.realpath, allowed_dirs)):
            raise ValueError(f"{path}: {what} {p} is not inside the directories this server takes placements "
                             f"from ({', '.join(allowed_dirs)}; --smoe-placement-dirs adds others)")

    inside(real, "placement file")
    cap = MAX_YAML_BYTES if like is None else yaml_bound(like)
    size = regular_file(real, "placement file", MAX_YAML_BYTES)
    if size > cap:
        raise ValueError(f"{path}: placement file is {size} bytes, over the {cap} a placement of this model "
                         f"({like.num_layers} layers x {like.num_experts} experts over {like.ep_size} ranks) can "
                         f"need; not read")
    data = read_bytes(real, "placement file", cap)
    placement = load_placement(real, data)
    tables = None
    if placement.predictor is not None:
        inside(os.path.realpath(placement.predictor), "field 'predictor': tables file")
        tables = read_bytes(os.path.realpath(placement.predictor), "tables file", _tables_bound(placement))
    return Snapshot(real, data, tables)


def load_tables(placement: Placement, data: bytes | None = None):
    """The predictor tables of a placement (``placement.predict.PredictorTables``); ``data``: the
    tables file's bytes as read before (:class:`Snapshot`), else the file is read."""
    from ..placement.predict import PredictorTables

    import zipfile
    import zlib

    if placement.predictor is None:
        raise ValueError(f"{placement.path}: field 'predictor' is empty; this placement has no tables")
    path = placement.predictor
    from .bounded import read_bytes

    bound = _tables_bound(placement)
    if data is None:
        data = read_bytes(path, "tables file", bound)
    elif len(data) > bound:
        raise ValueError(f"{path}: tables file is over the {bound} bytes a placement of {placement.num_layers} "
                         f"layers can hold")
    if placement.predictor_sha256 is not None and hashlib.sha256(data).hexdigest() != placement.predictor_sha256:
        raise ValueError(f"{path}: these tables are not the ones {placement.path} was built with (field "
                         f"'predictor_sha256' differs: an interrupted or concurrent smoe-place build?); rebuild")
    import io

    names = ("expert2rank", *PredictorTables.__dataclass_fields__)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            unpacked = sum(i.file_size for i in zf.infolist())
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable tables file ({type(e).__name__}: {e})") from None
    if unpacked > bound:  # a zip bomb, or tables of a far larger model
        raise ValueError(f"{path}: tables unpack to {unpacked} bytes, more than a placement of "
                         f"{placement.num_layers} layers can hold ({bound})")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in names if k in z}
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable tables file ({type(e).__name__}: {e})") from None
    groups = (("bigram_keys", "bigram2rank", "bigram_conf"),  # each group: all or none
              tuple(k for k in names if k.startswith("learned_")))
    optional = {k: g for g in groups for k in g}
    missing = [k for k in names if k not in arrays and (k not in optional or any(o in arrays for o in optional[k]))]
    if missing:
        raise ValueError(f"{path}: tables lack {missing}")
    e2r = arrays.pop("expert2rank")
    tables = PredictorTables(**arrays)
    if not np.array_equal(e2r, placement.expert2rank):
        raise ValueError(f"{path}: its expert2rank differs from {placement.path}'s field 'layers' (tables of "
                         f"another placement, or the YAML's layers were edited: rebuild the tables)")
    _check_tables(path, tables, placement)
    return tables


def _check_tables(path: str, t, placement: Placement) -> None:
    """Shapes, rank ranges and finite confidences: what a serving worker would index with."""
    L, E, N = placement.num_layers, placement.num_experts, placement.ep_size
    V = t.token2rank.shape[1] if t.token2rank.ndim == 3 else -1
    want = {"token2rank": (L, V, 2), "token_conf": (L, V), "markov2rank": (L, E, 2), "markov_conf": (L, E),
            "prior2rank": (L, 2), "prior_conf": (L,)}
    for name, shape in want.items():
        a = getattr(t, name)
        if a.shape != shape or V < 1:
            raise ValueError(f"{path}: table '{name}' has shape {a.shape}, expected {shape} for {L} layers, "
                             f"{E} experts")
        if name.endswith("2rank"):
            if a.dtype.kind not in "iu" or a.size and (a.min() < -1 or a.max() >= N):
                raise ValueError(f"{path}: table '{name}' holds ranks outside -1..{N - 1} (ep_size {N})")
        elif not np.isfinite(a.astype(np.float32)).all():
            raise ValueError(f"{path}: table '{name}' holds non-finite confidences")
    if placement.vocab_size is not None and V < placement.vocab_size:
        raise ValueError(f"{path}: table 'token2rank' covers {V} token ids but field 'model.vocab_size' is "
                         f"{placement.vocab_size}")
    if t.learned_token_proj is not None:
        _check_learned(path, t, V, L, N)
    if t.bigram_keys is not None:
        k = t.bigram_keys
        if k.ndim != 1 or k.dtype != np.int64 or k.size and (k[0] < 0 or k[-1] >= V * V or (np.diff(k) <= 0).any()):
            raise ValueError(f"{path}: table 'bigram_keys' must be strictly increasing int64 keys in 0..{V * V - 1} "
                             f"(previous id * {V} + id)")
        M = k.size
        for name, shape in (("bigram2rank", (L, M, 2)), ("bigram_conf", (L, M))):
            a = getattr(t, name)
            if a.shape != shape:
                raise ValueError(f"{path}: table '{name}' has shape {a.shape}, expected {shape} for {L} layers, "
                                 f"{M} pairs")
        b = t.bigram2rank
        if b.dtype.kind not in "iu" or b.size and (b.min() < -1 or b.max() >= N):
            raise ValueError(f"{path}: table 'bigram2rank' holds ranks outside -1..{N - 1} (ep_size {N})")
        if not np.isfinite(t.bigram_conf.astype(np.float32)).all():
            raise ValueError(f"{path}: table 'bigram_conf' holds non-finite confidences")


def _check_learned(path: str, t, V: int, L: int, N: int) -> None:
    """The learned predictor's shapes (one width D throughout) and finite float weights."""
    from ..placement.learned import MAX_WIDTH

    D = t.learned_token_proj.shape[1] if t.learned_token_proj.ndim == 2 else 0
    want = {"learned_token_proj": ((V, D), np.float16), "learned_prev_proj": ((V + 1, D), np.float16),
            "learned_hidden_bias": ((D,), np.float32), "learned_out_weight": ((D, L * N), np.float32),
            "learned_out_bias": ((L * N,), np.float32)}
    for name, (shape, dtype) in want.items():
        a = getattr(t, name)
        if a.shape != shape or not 1 <= D <= MAX_WIDTH:
            raise ValueError(f"{path}: table '{name}' has shape {a.shape}, expected {tuple(d or 'D' for d in shape)} "
                             f"for {L} layers, {N} ranks, {V} token ids and a width D in 1..{MAX_WIDTH}")
        if a.dtype != dtype or not np.isfinite(a).all():
            raise ValueError(f"{path}: table '{name}' must hold finite {np.dtype(dtype).name} values, got {a.dtype}")
