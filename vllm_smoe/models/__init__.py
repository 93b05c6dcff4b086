"""Model classes smoe builds for mode speculate (imported only inside vLLM workers)."""
