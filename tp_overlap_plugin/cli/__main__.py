"""`python -m tp_overlap_plugin.cli ...` is the `tp-overlap` command (what torchrun -m runs)."""

import sys

from .main import main

sys.exit(main())
