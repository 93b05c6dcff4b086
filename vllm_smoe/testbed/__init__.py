"""Tiny MoE testbed: offline checkpoints, trained multi-domain fixtures and their routing traces.

The trained fixtures ship with the package (``assets/``) so tests never retrain;
``smoe-testbed train --arch A`` reproduces them.
"""

from __future__ import annotations

import os

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
FIXTURE_MODEL = os.path.join(ASSETS, "tiny-qwen3moe-4dom")
FIXTURE_TRACES = {split: os.path.join(ASSETS, "traces", f"{split}.npz") for split in ("train", "heldout")}

# every trained fixture: architecture -> (checkpoint, {split: routing trace}); all share the
# Qwen3-MoE fixture's tokenizer, sizes (hidden 128, 32 routed experts, top-4) and domains
FIXTURES = {
    "qwen3_moe": (FIXTURE_MODEL, FIXTURE_TRACES),
    **{arch: (os.path.join(ASSETS, f"tiny-{arch.replace('_', '')}-4dom"),
              {split: os.path.join(ASSETS, "traces", arch, f"{split}.npz") for split in ("train", "heldout")})
       for arch in ("deepseek_v2", "deepseek_v3")},
}

# trained fixtures whose routing traces ship but whose checkpoint does not (over the package's
# 25 MB budget per checkpoint): name -> ({split: routing trace}, the command that reproduces the
# checkpoint). ``qwen3_moe_e64``: the Qwen3-MoE fixture's tokenizer, sizes, domains and training,
# with 64 experts and top-8, trained 1600 steps, not 2400 (30 MB fp32), for placements at EP 16
# on trained routing (docs/testbed.md).
TRACE_ONLY_FIXTURES = {
    "qwen3_moe_e64": (
        {split: os.path.join(ASSETS, "traces", "qwen3_moe_e64", f"{split}.npz") for split in ("train", "heldout")},
        "smoe-testbed train --experts 64 --top-k 8 --steps 1600 --threads 1 --tokenizer $(smoe-testbed path model) "
        "-o DIR",
    ),
}
# every shipped routing trace: fixture name -> {split: routing trace}
ALL_FIXTURE_TRACES = {**{name: traces for name, (_, traces) in FIXTURES.items()},
                      **{name: traces for name, (traces, _) in TRACE_ONLY_FIXTURES.items()}}
