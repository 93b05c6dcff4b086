"""Tiny MoE testbed: offline checkpoints, a trained multi-domain fixture and its routing traces.

The trained fixture ships with the package (``assets/``) so tests never retrain;
``smoe-testbed train`` reproduces it.
"""

from __future__ import annotations

import os

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
FIXTURE_MODEL = os.path.join(ASSETS, "tiny-qwen3moe-4dom")
FIXTURE_TRACES = {split: os.path.join(ASSETS, "traces", f"{split}.npz") for split in ("train", "heldout")}
