"""`tp-overlap tune`: measure the --tp-overlap tables for this machine, TP size and model
(tuning/tune.py), into the per-user cache; or, with `--shapes shipped`, this device's config tables of
every shipped model's shapes (what the package ships in gemm_tables/ and decode_tables/).

    tp-overlap tune --tp 2 --model llama-3-8b
    tp-overlap tune --tp 1 --shapes shipped

The measuring code (Triton) is imported when `tune` runs, not when the parser is built.
"""

from __future__ import annotations

import argparse
import os

from tp_overlap_plugin.serving.user_errors import CliError
from tp_overlap_plugin.tuning.plan import ONLY_CHOICES, SHAPES   # (no Triton: the plan's shapes only)
from tp_overlap_plugin.tuning.store import DEVICE_PHASES
from tp_overlap_plugin.options import FUSED_OPS

from .engine_args import check_tp_option
from .parser import add_debug_arg


def run_tune(args: argparse.Namespace) -> int:
    """Measure the flag's tables on this machine for this TP size and model (tuning/tune.py)."""
    from tp_overlap_plugin import tables
    from tp_overlap_plugin.serving.config import EngineConfig

    only = _shipped_only(args) if args.shapes == "shipped" else args.only
    try:  # before anything is measured: a cache it cannot write would lose the run
        tables.writable_or_raise(tables.cache_dir())
    except PermissionError as e:
        raise CliError(str(e), status=1) from None
    if args.shapes == "shipped":
        return _run_shipped(args, only)
    args.model = args.model or "demo"
    try:
        mcfg = EngineConfig(model=args.model).load_model_config()
    except (FileNotFoundError, ValueError) as e:
        raise CliError(str(e)) from None
    from tp_overlap_plugin.shapes import ModelDims
    from tp_overlap_plugin.tuning.tune import run

    device = _device(args)
    check_tp_option(mcfg, args.tp)
    dims = ModelDims.of(mcfg)
    label = os.path.basename(os.path.normpath(args.model))
    return run(label, dims, args.tp, device, quick=args.quick, budget_min=args.budget_min, force=args.force,
               margin=args.margin, engine_margin=args.engine_margin, model_spec=args.model,
               step_budget=args.max_num_batched_tokens, only=only, fused_ops=args.fused_ops)


def _device(args: argparse.Namespace) -> str:
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and torch.cuda.device_count() < args.tp:
        raise CliError(f"--tp {args.tp} needs {args.tp} GPUs on this machine, found {torch.cuda.device_count()}")
    return device


def _shipped_only(args: argparse.Namespace) -> tuple[str, ...]:
    """--shapes shipped's phases: the config tables' (--only may pick one of them); a usage error (exit
    2) for an option that asks for what it does not measure, before anything starts."""
    unused = [opt for opt, given in (("--model", args.model is not None), ("--margin", args.margin is not None),
                                     ("--engine-margin", args.engine_margin is not None),
                                     ("--max-num-batched-tokens", args.max_num_batched_tokens is not None),
                                     ("--fused-ops", args.fused_ops != "auto")) if given]
    if unused:
        raise CliError(f"--shapes shipped measures the config tables ({', '.join(DEVICE_PHASES)}) of every shipped "
                       f"model's shapes: {' and '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply to it")
    other = [p for p in args.only or () if p not in DEVICE_PHASES]
    if other:
        raise CliError(f"--shapes shipped measures the config tables' phases ({', '.join(DEVICE_PHASES)}) only; "
                       f"--only {','.join(other)} measures one model at one TP size: use --model instead")
    return args.only or DEVICE_PHASES


def _run_shipped(args: argparse.Namespace, only: tuple[str, ...]) -> int:
    from tp_overlap_plugin.tuning.tune import run
    return run(None, None, args.tp, _device(args), quick=args.quick, budget_min=args.budget_min, force=args.force,
               only=only, shapes="shipped")


def _phases(text: str) -> tuple[str, ...]:
    """--only's value: phases separated by commas, each one tune runs."""
    phases = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in phases if p not in ONLY_CHOICES]
    if bad or not phases:
        raise argparse.ArgumentTypeError(f"unknown phase(s) {bad or [text]}; the phases are {', '.join(ONLY_CHOICES)}")
    return phases


def add_tune_subcommand(sub) -> argparse.ArgumentParser:
    """Register `tune` on the `tp-overlap` parser's subparsers."""
    t = sub.add_parser("tune", help="measure the --tp-overlap tables for this machine, TP size and model, into the "
                                    "per-user cache (then `serve --tp-overlap` uses them)")
    t.add_argument("--tp", type=int, required=True, help="the TP size to measure (starts that many ranks here)")
    t.add_argument("--model", default=None,
                   help="a shipped config name (llama-3-8b, llama-3-70b, qwen2.5-7b), a model directory or "
                        "'demo' (the default): its shard shapes are measured")
    t.add_argument("--shapes", choices=SHAPES, default="model",
                   help="model: --model's shard shapes at --tp, every phase; shipped: the shard shapes of "
                        "every model config shipped with the engine at TP=1,2,4,8, for this device's GEMM and decode "
                        "config tables alone (the tables the package ships); --tp ranks, one GPU each, share the "
                        "work (a shard's shape is measured on one GPU)")
    t.add_argument("--quick", action="store_true", help="fewer sizes and configs (about 3 minutes at TP=8)")
    t.add_argument("--budget-min", type=float, default=None,
                   help="stop starting new measurements after this many minutes (default 10, --quick 3); "
                        "a rerun resumes")
    t.add_argument("--force", action="store_true", help="measure everything again, ignoring cached rows")
    t.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present")
    t.add_argument("--margin", type=float, default=None,
                   help="ours is chosen where it is at least this many times faster than stock in every repeat "
                        "(default 1.02; 0 picks ours wherever it ran correctly, for tests of the pipeline); "
                        "the engine's check too, unless --engine-margin")
    t.add_argument("--engine-margin", type=float, default=None,
                   help="a step size keeps the flag where its engine step is at least this many times faster than "
                        "the stock engine's in every repeat, else it runs stock (default 1.01)")
    t.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the step token budget the engine check's largest prefill step fills (default 8192 on GPUs, "
                        "vLLM's default; serve with the same budget)")
    t.add_argument("--only", type=_phases, default=None, metavar="PHASE[,PHASE]",
                   help=f"measure these phases only ({', '.join(ONLY_CHOICES)}); the tables are built from every "
                        f"row stored before too")
    t.add_argument("--fused-ops", choices=list(FUSED_OPS), default="auto",
                   help="the AG-GEMM / GEMM-RS designs to measure: auto (default): every design, and the engine's "
                        "verdict chooses the one the table holds (and the engine runs); or one design alone")
    add_debug_arg(t)
    t.set_defaults(func=run_tune)
    return t
