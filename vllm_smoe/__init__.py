"""smoe: Speculative MoE / Semantic Parallelism as a vLLM out-of-tree plugin.

Importing this package imports neither torch nor vLLM; heavy pieces load lazily.
"""

__version__ = "0.1.0"
