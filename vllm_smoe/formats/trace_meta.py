"""The fields of a routing trace and its ``meta`` header (the format's table is in
:class:`~.trace_reader.Trace`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

FORMAT_VERSION = 1

# name -> (allowed dtypes, rank). Rank 1 fields are [T]; rank 3 are [T, L, K].
FIELD2SPEC: dict[str, tuple[tuple[np.dtype, ...], int]] = {
    "token_ids": ((np.dtype(np.int32),), 1),
    "request_ids": ((np.dtype(np.int32),), 1),
    "positions": ((np.dtype(np.int32),), 1),
    "topk_ids": ((np.dtype(np.int16), np.dtype(np.int32)), 3),
    "step_ids": ((np.dtype(np.int32),), 1),
    "is_prefill": ((np.dtype(np.bool_),), 1),
    "domain": (tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64)), 1),
    "topk_weights": ((np.dtype(np.float16), np.dtype(np.float32)), 3),
}
REQUIRED_FIELDS = ("token_ids", "request_ids", "positions", "topk_ids")
OPTIONAL_FIELDS = ("step_ids", "is_prefill", "domain", "topk_weights")
_META_REQUIRED = ("num_experts", "top_k", "num_layers", "vocab_size")
# characters of the meta JSON a reader takes (and a writer writes): smoe's own is under 1 kB plus
# the domain names; a reader that trusts a header's string size would allocate whatever it claims
MAX_META_CHARS = 1 << 20


@dataclass(frozen=True)
class TraceMeta:
    num_experts: int
    top_k: int
    num_layers: int
    vocab_size: int
    domains: tuple[str, ...] = ()
    model: str | None = None
    hidden_size: int | None = None
    extra: Mapping[str, object] = field(default_factory=dict)

    def to_json(self) -> str:
        d: dict[str, object] = dict(self.extra)
        d.update(
            format_version=FORMAT_VERSION,
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_layers=self.num_layers,
            vocab_size=self.vocab_size,
        )
        if self.domains:
            d["domains"] = list(self.domains)
        if self.model is not None:
            d["model"] = self.model
        if self.hidden_size is not None:
            d["hidden_size"] = self.hidden_size
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "meta") -> "TraceMeta":
        if not isinstance(text, str):
            raise ValueError(f"{where}: field 'meta' must be a JSON string, got {type(text).__name__}")
        if len(text) > MAX_META_CHARS:
            raise ValueError(f"{where}: field 'meta' is {len(text)} characters, over the {MAX_META_CHARS} smoe reads")
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: field 'meta' is not valid JSON ({e})") from None
        except RecursionError:
            raise ValueError(f"{where}: field 'meta' is nested too deeply") from None
        if not isinstance(d, dict):
            raise ValueError(f"{where}: field 'meta' must be a JSON object, got {type(d).__name__}")
        for key in _META_REQUIRED:
            if key not in d:
                raise ValueError(f"{where}: field 'meta' lacks required key {key!r}")
            v = d[key]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{where}: field 'meta.{key}' must be a positive integer, got {v!r}")
        if d["top_k"] > d["num_experts"]:
            raise ValueError(
                f"{where}: field 'meta.top_k' = {d['top_k']} exceeds meta.num_experts = {d['num_experts']}"
            )
        domains = d.get("domains", [])
        if not isinstance(domains, list) or not all(isinstance(s, str) for s in domains):
            raise ValueError(f"{where}: field 'meta.domains' must be a list of strings, got {domains!r}")
        hidden = d.get("hidden_size")
        if hidden is not None and (not isinstance(hidden, int) or hidden <= 0):
            raise ValueError(f"{where}: field 'meta.hidden_size' must be a positive integer, got {hidden!r}")
        known = set(_META_REQUIRED) | {"domains", "model", "hidden_size", "format_version"}
        return cls(
            num_experts=d["num_experts"],
            top_k=d["top_k"],
            num_layers=d["num_layers"],
            vocab_size=d["vocab_size"],
            domains=tuple(domains),
            model=d.get("model"),
            hidden_size=hidden,
            extra={k: v for k, v in d.items() if k not in known},
        )
