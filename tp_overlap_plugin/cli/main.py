"""The `tp-overlap` command (pyproject's console script): its parser, made of each subcommand's
module here, and the run of a parsed command.

    tp-overlap serve | generate | bench serve | bench throughput | bench latency | tune | demo
    python -m tp_overlap_plugin.cli ...                 # the same command (torchrun -m too)

Nothing of Triton is imported before the command has parsed its arguments: without a GPU the kernels
run under the Triton interpreter, which Triton reads once, when it is imported (see
`_interpret_kernels_without_gpu`). So the subcommands' modules are imported in `build_parser`, after
that decision, and each imports the engine or the measuring code only when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from tp_overlap_plugin import options
from tp_overlap_plugin.serving.user_errors import DEBUG_HINT, CliError

from .parser import Parser, report_error


def build_parser() -> argparse.ArgumentParser:
    from .bench import add_bench_subcommand
    from .demo import add_demo_subcommand
    from .generate import add_generate_subcommand
    from .serve import add_serve_subcommand
    from .tune import add_tune_subcommand

    p = Parser(prog="tp-overlap", description="tensor-parallel serving with overlapped kernels")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo_subcommand(sub)
    add_tune_subcommand(sub)
    add_generate_subcommand(sub)
    add_serve_subcommand(sub)
    add_bench_subcommand(sub)
    return p


def _interpret_kernels_without_gpu(argv) -> None:
    """Without a GPU (or with `--device cpu`) our Triton kernels can only run under the Triton
    interpreter, and Triton reads TRITON_INTERPRET once, when it is imported: so it is set here,
    before the parser imports the engine. The CPU engine runs no other Triton kernel, and an
    explicit TRITON_INTERPRET in the environment wins."""
    if "triton" in sys.modules or options.env_triton_interpret() is not None:
        return
    argv = list(sys.argv[1:] if argv is None else argv)
    cpu = "--device=cpu" in argv or any(a == "--device" and b == "cpu" for a, b in zip(argv, argv[1:]))
    if not cpu:
        import torch
        cpu = not torch.cuda.is_available()
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"


def _run(args: argparse.Namespace, prog: str) -> int:
    """Run a parsed subcommand. A failure is one line and a hint on stderr; the traceback only with
    --debug."""
    debug = getattr(args, "debug", False)
    try:
        if getattr(args, "tp", 1) < 1:
            raise CliError(f"--tp must be >= 1, got {args.tp}")
        return args.func(args)
    except CliError as e:
        if debug:
            raise
        report_error(prog, e.message, e.hint)
        return e.status
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        report_error(prog, CliError(f"{type(e).__name__}: {e}").message, DEBUG_HINT)
        return 1


def main(argv=None) -> int:
    _interpret_kernels_without_gpu(argv)
    args = build_parser().parse_args(argv)
    prog = " ".join(["tp-overlap", args.command] + ([args.bench_command] if args.command == "bench" else []))
    return _run(args, prog)

