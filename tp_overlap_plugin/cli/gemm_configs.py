"""The GEMM core's measuring command (tuning/gemm_configs.py says what it measures); `tp-overlap tune
--only gemm_configs` runs the same phase and writes the table.

    python -m tp_overlap_plugin.cli.gemm_configs measure [--out DIR] [--budget-s 420] [--dry-run]
"""

from __future__ import annotations

import argparse
import os


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None


def main(argv=None, results_dir: str | os.PathLike = ".") -> None:
    from tp_overlap_plugin.tuning import gemm_configs

    d = gemm_configs.MeasureRun()
    p = argparse.ArgumentParser(description=gemm_configs.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="time the candidates against cuBLAS on this GPU, write the results")
    m.add_argument("--out", default=str(results_dir), help="results directory (JSON + md)")
    m.add_argument("--budget-s", type=float, default=d.budget_s, help="stop starting new shapes after this many seconds")
    m.add_argument("--tp", type=_ints, default=d.tp)
    m.add_argument("--m", type=_ints, default=d.m, help="M values, in the order they are measured")
    m.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    args = p.parse_args(argv)
    gemm_configs.measure(gemm_configs.MeasureRun(out=args.out, budget_s=args.budget_s, tp=args.tp, m=args.m,
                                                 dry_run=args.dry_run))


if __name__ == "__main__":
    main()
