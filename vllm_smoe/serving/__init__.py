"""vLLM glue of smoe: everything here runs inside vLLM's processes (imports torch and vLLM lazily)."""
