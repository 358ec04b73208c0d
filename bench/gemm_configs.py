"""The GEMM core against cuBLAS on one GPU: the command line of tp_overlap_plugin/tuning/gemm_configs.py
(the code `tp-overlap tune` measures with; its docstring says what is measured and the table's rules),
writing results into bench/results by default. The table is tune's to write
(`tp-overlap tune --only gemm_configs`).

    python bench/gemm_configs.py measure [--out bench/results] [--budget-s 420]
    python bench/gemm_configs.py measure --dry-run --m 16,1      # CPU, interpreter, tiny shapes
"""

import os
import sys

from tp_overlap_plugin.tuning import gemm_configs
from tp_overlap_plugin.tuning.gemm_configs import *  # noqa: F401,F403  (build_table, LAYOUT, ...: tests use them)

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

if __name__ == "__main__":
    sys.exit(gemm_configs.main(results_dir=RESULTS_DIR))
