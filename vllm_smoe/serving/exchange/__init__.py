"""Expert-parallel transports: vLLM's EP on its CPU build, smoe's sparse all2all, collectives."""
