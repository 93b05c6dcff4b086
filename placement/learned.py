"""A learned token -> rank predictor: a small network over the token's and the previous token's
input embeddings, one rank preference per MoE layer (pure numpy; no tables indexed by layer and id).

What the tables cannot do: a token id seen in another context, or never seen, still gets a
preference from where its embedding lies, and the previous token shifts it. The network and
its training: :class:`LearnedPredictor`. Serving runs two gathers and one [T, D] x [D, L * N]
GEMM per step, on token ids alone. Per
layer it defers to the token tables where they are the more confident (:func:`with_tables`);
for one order per step it ranks by expected local activations summed over layers.
Notation: T tokens, L layers, K top-k, E experts, N ranks, V vocabulary, H hidden size, D width."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LEARNED_FIELDS = ("token_proj", "prev_proj", "hidden_bias", "out_weight", "out_bias")
MAX_WIDTH = 256  # D: what a tables file may hold (its size bound counts on it)


def default_width(num_ranks: int) -> int:
    """D for N ranks: more outputs per layer need a wider layer (measured on the fixture: at EP 8
    width 128 keeps 0.278 of activations local per layer where 64 keeps 0.275, the tables 0.276)."""
    return int(min(MAX_WIDTH, max(64, 16 * num_ranks)))


@dataclass(frozen=True)
class LearnedPredictor:
    """The network:

        h = relu(token_proj[id] + prev_proj[prev] + hidden_bias)          [T, D]
        logits = h @ out_weight + out_bias                                  [T, L * N]

    trained by soft cross-entropy against each token's share of top-k experts on every rank, per
    layer. ``token_proj`` / ``prev_proj`` are the embeddings times learned projections, folded into
    per-id rows after training (with no embeddings, free per-id rows that unseen ids leave at zero).

    token_proj: [V, D] float16, the first layer's contribution of the token id;
    prev_proj: [V + 1, D] float16, that of the previous row's id, row V = none (the row starts
    its sequence in the step, or continues one from an earlier step); both are read as float32
    (half the bytes of the largest arrays, in the file and on the device; the same numbers
    offline and served); hidden_bias: [D] float32;
    out_weight: [D, L * N] float32 and out_bias: [L * N] float32, layer-major (column l * N + n
    scores rank n at MoE layer l)."""

    token_proj: np.ndarray
    prev_proj: np.ndarray
    hidden_bias: np.ndarray
    out_weight: np.ndarray
    out_bias: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(sum(getattr(self, k).nbytes for k in self.__dataclass_fields__))

    @property
    def width(self) -> int:
        return int(self.token_proj.shape[1])

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays under their names in the tables file (``PredictorTables``' learned_* fields)."""
        return {"learned_" + k: getattr(self, k) for k in LEARNED_FIELDS}


def layer_targets(topk_ids: np.ndarray, holds: np.ndarray) -> np.ndarray:
    """[T, L, N] float32: the share of each token's activations each rank holds, per layer (a
    replicated expert counts on every rank holding a copy; rows sum to 1 when every expert has
    one home). topk_ids: [T, L, K] int; holds: [L, N, E] bool."""
    T, L, K = topk_ids.shape
    out = np.empty((T, L, holds.shape[1]), dtype=np.float32)
    for layer in range(L):
        counts = holds[layer][:, topk_ids[:, layer].astype(np.int64)].sum(axis=2).T  # [T, N]
        out[:, layer] = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    return out


def forward(model: LearnedPredictor, token_ids: np.ndarray, prev_ids: np.ndarray) -> np.ndarray:
    """[T, L * N] float32 logits. token_ids: [T] int; prev_ids: [T] int, -1 = none."""
    V = model.token_proj.shape[0]
    prev = np.where(prev_ids >= 0, prev_ids, V).astype(np.int64)
    h = (model.token_proj[token_ids.astype(np.int64)].astype(np.float32) + model.prev_proj[prev].astype(np.float32)
         + model.hidden_bias)
    return np.maximum(h, 0.0) @ model.out_weight + model.out_bias


def preferences(logits: np.ndarray, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, ranks by score (best first, lower rank on ties) and the best rank's softmax
    probability. logits: [T, L * N]. Returns (pref [L, T, min(2, N)] int64, conf [L, T] float32)."""
    T = logits.shape[0]
    z = logits.reshape(T, logits.shape[1] // num_ranks, num_ranks).transpose(1, 0, 2)  # [L, T, N]
    pref = np.argsort(-z, axis=2, kind="stable")[..., : min(2, num_ranks)]
    p = np.exp(z - z.max(axis=2, keepdims=True))
    conf = (1.0 / p.sum(axis=2)).astype(np.float32)  # the best rank's exp is 1 after the shift
    return pref.astype(np.int64), conf


def with_tables(table_pref: np.ndarray, table_conf: np.ndarray, pref: np.ndarray, conf: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """Per token and layer, the token tables' preference where their confidence is higher (both
    estimate the share of the token's activations its best rank holds), else the network's: the
    order per layer of predictor ``learned``. table_pref: [..., 2] int, table_conf: [...] (the
    tables' rows, prior where unseen; any leading shape, e.g. [L, T] or one layer's [T]); pref,
    conf: :func:`preferences`' of the same rows. Returns (pref [..., P] int64, conf [...]
    float32), P = pref's width."""
    use = table_conf > conf
    P = pref.shape[-1]
    return (np.where(use[..., None], table_pref[..., :P], pref).astype(np.int64),
            np.maximum(table_conf, conf).astype(np.float32))


def step_preferences(logits: np.ndarray, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """One preference per token for every layer at once (the order a whole step keeps): ranks by
    the activations they are expected to keep local summed over layers (each layer's softmax),
    best first, lower rank on ties. logits: [T, L * N]. Returns (pref [T, min(2, N)] int64,
    conf [T] float32, the best rank's expected share of the token's activations)."""
    T = logits.shape[0]
    z = logits.reshape(T, logits.shape[1] // num_ranks, num_ranks)
    p = np.exp(z - z.max(axis=2, keepdims=True))
    score = (p / p.sum(axis=2, keepdims=True)).sum(axis=1)  # [T, N]
    pref = np.argsort(-score, axis=1, kind="stable")[:, : min(2, num_ranks)]
    return pref.astype(np.int64), (score[np.arange(T), pref[:, 0]] / z.shape[1]).astype(np.float32)


def train_predictor(token_ids: np.ndarray, prev_ids: np.ndarray, targets: np.ndarray, vocab_size: int,
                    embeddings: np.ndarray | None = None, width: int = 64, epochs: int = 6,
                    batch: int = 1024, lr: float = 3e-3, weight_decay: float = 1e-4, seed: int = 0
                    ) -> LearnedPredictor:
    """Fit the network (Adam, minibatches in a seeded order: the same inputs give the same bytes).

    token_ids: [T] int; prev_ids: [T] int, -1 = none; targets: [T, L, N] from
    :func:`layer_targets`; embeddings: [>= V, H] float input embeddings, or None for free per-id
    rows. Returns the folded :class:`LearnedPredictor`."""
    T, L, N = targets.shape
    if T == 0:
        raise ValueError("no tokens to train the learned predictor on")
    if not 1 <= width <= MAX_WIDTH or epochs < 1 or batch < 1:
        raise ValueError(f"width must be in 1..{MAX_WIDTH}, epochs and batch >= 1; got {width}, {epochs}, {batch}")
    rng = np.random.default_rng(seed)
    V, D = vocab_size, width
    tok = token_ids.astype(np.int64)
    prev = np.where(prev_ids >= 0, prev_ids, V).astype(np.int64)
    if embeddings is not None:
        if embeddings.shape[0] < V:
            raise ValueError(f"embeddings have {embeddings.shape[0]} rows, fewer than vocab_size {V}")
        H = embeddings.shape[1]
        emb = np.zeros((V + 1, H), dtype=np.float32)  # row V: no previous id
        emb[:V] = embeddings[:V]
        emb[:V] /= max(float(np.sqrt(np.einsum("vh,vh->v", emb[:V], emb[:V]).mean())), 1e-12)  # unit rms row norm
        params = {"w_tok": rng.normal(0, 1 / np.sqrt(H), (H, D)), "w_prev": rng.normal(0, 1 / np.sqrt(H), (H, D)),
                  "start": np.zeros(D)}
    else:
        emb = None
        params = {"tok": rng.normal(0, 0.1, (V, D)), "prev": rng.normal(0, 0.1, (V + 1, D))}
    params.update(b1=np.zeros(D), w2=rng.normal(0, 1 / np.sqrt(D), (D, L * N)), b2=np.zeros(L * N))
    params = {k: v.astype(np.float32) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v2 = {k: np.zeros_like(v) for k, v in params.items()}
    step = 0
    for _ in range(epochs):
        order = rng.permutation(T)
        for s in range(0, T, batch):
            rows = order[s: s + batch]
            ti, pi = tok[rows], prev[rows]
            if emb is not None:
                xt, xp = emb[ti], emb[pi]
                pre = xt @ params["w_tok"] + xp @ params["w_prev"] + params["b1"]
                pre[pi == V] += params["start"]
            else:
                pre = params["tok"][ti] + params["prev"][pi] + params["b1"]
            h = np.maximum(pre, 0.0)
            z = (h @ params["w2"] + params["b2"]).reshape(-1, L, N)
            p = np.exp(z - z.max(axis=2, keepdims=True))
            p /= p.sum(axis=2, keepdims=True)
            # soft cross-entropy, per layer, averaged over tokens and layers
            dz = ((p - targets[rows]) / (rows.size * L)).reshape(-1, L * N)
            grads = {"w2": h.T @ dz, "b2": dz.sum(axis=0)}
            dpre = (dz @ params["w2"].T) * (pre > 0)
            grads["b1"] = dpre.sum(axis=0)
            if emb is not None:
                grads["w_tok"] = xt.T @ dpre
                grads["w_prev"] = xp.T @ dpre
                grads["start"] = dpre[pi == V].sum(axis=0)
            else:
                grads["tok"] = np.zeros_like(params["tok"])
                np.add.at(grads["tok"], ti, dpre)
                grads["prev"] = np.zeros_like(params["prev"])
                np.add.at(grads["prev"], pi, dpre)
            step += 1
            for k, g in grads.items():  # Adam with decoupled weight decay
                m[k] = 0.9 * m[k] + 0.1 * g
                v2[k] = 0.999 * v2[k] + 0.001 * g * g
                mh, vh = m[k] / (1 - 0.9 ** step), v2[k] / (1 - 0.999 ** step)
                params[k] -= (lr * (mh / (np.sqrt(vh) + 1e-8) + weight_decay * params[k])).astype(np.float32)
    if emb is not None:
        token_proj = emb[:V] @ params["w_tok"]
        prev_proj = emb @ params["w_prev"]
        prev_proj[V] += params["start"]
    else:
        seen = np.zeros(V + 1, dtype=bool)
        seen[tok] = True
        token_proj = np.where(seen[:V, None], params["tok"], 0.0)
        seen_prev = np.zeros(V + 1, dtype=bool)
        seen_prev[prev] = True
        prev_proj = np.where(seen_prev[:, None], params["prev"], 0.0)
    return LearnedPredictor(token_proj=token_proj.astype(np.float16), prev_proj=prev_proj.astype(np.float16),
                            hidden_bias=params["b1"].astype(np.float32), out_weight=params["w2"].astype(np.float32),
                            out_bias=params["b2"].astype(np.float32))
