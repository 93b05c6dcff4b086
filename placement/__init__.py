"""Offline placement algorithms: pure numpy/scipy, arrays in, arrays out (no torch, vLLM or I/O)."""
