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
