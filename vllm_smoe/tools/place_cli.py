"""``python -m vllm_smoe.tools.place_cli``: ``smoe-place`` (vllm_smoe/tools/place/) under the
module path the served tests and the cluster bench still start it by."""

import sys

from .place import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
