"""Triton kernels for token shuffling, each beside a pure-torch ``ref_*`` reference."""
