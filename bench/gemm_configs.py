"""The GEMM core against cuBLAS on one GPU, and the config table `pick_config` reads: the command line
of tp_overlap_plugin/tuning/gemm_configs.py (the code `tp-overlap tune` measures with; its docstring
says what is measured and the table's rules), writing into bench/results by default.

    python bench/gemm_configs.py measure [--out bench/results] [--table-out PATH] [--budget-s 420]
    python bench/gemm_configs.py table bench/results/gemm-configs-h200-DATE.json [--table-out PATH]
    python bench/gemm_configs.py measure --dry-run --m 16,1      # CPU, interpreter, tiny shapes
"""

import os
import sys

from tp_overlap_plugin.tuning import gemm_configs
from tp_overlap_plugin.tuning.gemm_configs import *  # noqa: F401,F403  (build_table, LAYOUT, ...: tests use them)

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

if __name__ == "__main__":
    sys.exit(gemm_configs.main(results_dir=RESULTS_DIR))
