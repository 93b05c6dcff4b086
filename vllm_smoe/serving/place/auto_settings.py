"""The automatic re-placement's settings (``auto_replace``), parsed where smoe's settings are."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class AutoSettings:
    """hold_s: seconds the pooled drift verdict must read drifted before a candidate is built;
    cooldown_s: seconds after a swap (or a rejected candidate) before the next build; max_moves:
    share of expert slots a swap may move (advise --max-moves); margin: the candidate's held-out
    local activation ratio must exceed the served one's by this share; window_tokens: recent
    recorded tokens the build reads (advise --max-tokens); min_tokens: recorded tokens since drift
    began needed before a build (half train, half judge: fewer make a candidate of noise);
    build_timeout_s, build_mem_mb,
    build_cpu_s: the build process's wall-clock, address-space and CPU-time limits;
    build_cpu_share: the share of one core the build may run at (in (0, 1]; below 1 it is stopped
    and continued every 100 ms): for hosts where serving occupies every core, which a build at
    nice 19 still slows (docs: live re-placement)."""
    hold_s: float = 60.0
    cooldown_s: float = 600.0
    max_moves: float = 0.25
    margin: float = 0.02
    window_tokens: int = 1 << 18
    min_tokens: int = 1 << 14
    build_timeout_s: float = 600.0
    build_mem_mb: int = 4096
    build_cpu_s: float = 600.0
    build_cpu_share: float = 1.0

    @classmethod
    def from_value(cls, v: object, where: str) -> "AutoSettings | None":
        """``auto_replace`` as settings give it: false/None (off), true (defaults) or a mapping of
        the fields above; ValueError naming the field otherwise."""
        if v is None or v is False:
            return None
        if v is True:
            return cls()
        if not isinstance(v, dict):
            raise ValueError(f"{where}: field 'auto_replace' must be true, false or a mapping of "
                             f"{', '.join(cls.__dataclass_fields__)}, got {v!r}")
        unknown = sorted(set(v) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{where}: field 'auto_replace': unknown field(s) {unknown}; known: "
                             f"{', '.join(cls.__dataclass_fields__)}")
        out = {}
        for name, f in cls.__dataclass_fields__.items():
            x = v.get(name, f.default)
            whole = f.type in (int, "int")
            ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and (
                isinstance(x, int) if whole else True)
            lo_ok = ok and (x >= 0 if name in ("hold_s", "cooldown_s", "margin") else x > 0)
            if not lo_ok or (name in ("max_moves", "build_cpu_share") and x > 1):
                kind = "a positive integer" if whole else ("a number in (0, 1]" if name in ("max_moves",
                                                                                            "build_cpu_share") else
                                                           "a non-negative number" if name in
                                                           ("hold_s", "cooldown_s", "margin") else "a positive number")
                raise ValueError(f"{where}: field 'auto_replace.{name}' must be {kind}, got {x!r}")
            out[name] = int(x) if whole else float(x)
        return cls(**out)

    def to_dict(self) -> dict:
        return asdict(self)
