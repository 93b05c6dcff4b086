"""``python -m vllm_smoe.tools.place``: ``smoe-place``."""

import sys

from . import main

sys.exit(main())
