"""Counters, drift and smoe's families on vLLM's ``/metrics``."""
