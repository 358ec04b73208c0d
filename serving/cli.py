"""The `tp-overlap` command's engine subcommands: serve, generate, bench, demo. The whole command
(these and `tune`) is tp_overlap_plugin/tuning/cli.py's `main`: tuning builds engines, so it sits above
serving/ and registers its subcommand there; nothing here imports it.

    tp-overlap generate --prompt "Hello"                          # embedded demo model, nothing downloaded
    tp-overlap generate --model /models/Llama-3.1-8B --tp 2 --prompt "Hi" --chat
    torchrun --nproc-per-node 2 -m tp_overlap_plugin.serving.cli generate --model ... --tp 2 --prompt "Hi"

The subcommands live with the engine, not in the plugin's core: the plugin (layers, heap, kernels) is
what vLLM loads, and it must never import the engine. The engine's options (`add_engine_args`,
`engine_config_from_args`) live in args.py, shared with the server and the offline benches.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Optional, Sequence

from tp_overlap_plugin import options

from .args import (DEBUG_HINT, CliError, Parser, add_debug_arg, add_engine_args,
                   describe_validation_error, engine_config_from_args, report_error)
from .config import SamplingParams


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    g = p.add_argument_group("sampling")
    g.add_argument("--prompt", action="append", default=None, help="repeatable; default: one demo prompt")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 disables")
    g.add_argument("--top-p", type=float, default=1.0, help="1 disables")
    g.add_argument("--min-p", type=float, default=0.0, help="0 disables")
    g.add_argument("--sample-seed", type=int, default=None, help="seed of the sampling (default: the engine's)")
    g.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    g.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens even past end-of-sequence")
    add_debug_arg(p)
    p.set_defaults(func=run_generate)


_SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_k": "--top-k",
                   "top_p": "--top-p", "min_p": "--min-p", "seed": "--sample-seed", "stop": "--stop"}


def run_generate(a: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from .engine.llm import LLM

    cfg = engine_config_from_args(a)
    try:
        sp = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                            min_p=a.min_p, seed=a.sample_seed, stop=a.stop, ignore_eos=a.ignore_eos)
    except ValidationError as e:
        raise CliError(describe_validation_error(e, _SAMPLING_FLAGS)) from None
    prompts = a.prompt or ["The tensor-parallel engine says:"]
    llm = LLM(cfg)
    if not llm.is_driver:      # a torchrun worker rank: it served rank 0 until shutdown
        return 0
    try:
        t0 = time.perf_counter()
        if a.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp)
        else:
            outs = llm.generate(prompts, sp)
        dt = time.perf_counter() - t0
        n = 0
        for o in outs:
            c = o.outputs[0]
            n += len(c.token_ids)
            print(f"--- prompt: {o.prompt!r}\n{c.text}\n[{len(c.token_ids)} tokens, finish: {c.finish_reason}]")
        print(f"{n} tokens in {dt:.2f} s ({n / max(dt, 1e-9):.1f} tok/s)", file=sys.stderr)
    finally:
        llm.shutdown()
    return 0


def add_generate_subcommand(subparsers) -> argparse.ArgumentParser:
    """Register `generate` on the `tp-overlap` parser's subparsers; dispatch via args.func(args)."""
    p = subparsers.add_parser("generate", help="offline generation with the built-in engine")
    _add_generate_args(p)
    return p


def generate_main(argv: Optional[list[str]] = None) -> int:
    p = Parser(prog="tp-overlap generate", description="offline generation")
    _add_generate_args(p)
    return _run(p.parse_args(argv), p.prog)


# ---- the `tp-overlap` command ------------------------------------------------------------------

def _demo(args) -> int:
    """Start `--tp` ranks, build the symmetric heap, all-reduce random tensors through it and check
    the sums against torch. On the CPU the kernels run under the Triton interpreter."""
    import torch

    from tp_overlap_plugin.multirank import run_ranks

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    results = run_ranks(_demo_rank, args.tp, (args.numel, args.iters), device=device,
                        heap_size=args.heap_size, timeout=args.timeout)
    for line in results[0]:
        print(line)
    return 0


def _demo_rank(ctx, numel, iters):
    import time

    import torch

    from tp_overlap_plugin import stats
    from tp_overlap_plugin.ops.all_reduce import HeapAllReduce

    comm = HeapAllReduce(ctx.heap, max_bytes=max(numel * 4, 1))
    lines = [f"{ctx.heap!r}", f"heap_bases = {[hex(b) for b in ctx.heap.heap_bases.tolist()]}"]
    for dtype in (torch.float32, torch.bfloat16):
        worst = 0.0
        t0 = time.perf_counter()
        for i in range(iters):
            gen = torch.Generator().manual_seed(1000 * i)
            xs = [torch.randn(numel, generator=gen).to(dtype) for _ in range(ctx.world_size)]
            y = comm(xs[ctx.rank].to(ctx.device))
            ref = torch.stack([x.double() for x in xs]).sum(0)
            worst = max(worst, ((y.double().cpu() - ref).norm() / ref.norm()).item())
        ctx.heap.check()
        dt = (time.perf_counter() - t0) / iters
        lines.append(f"all_reduce {dtype} x{numel}: rel. error {worst:.2e}, {dt * 1e3:.1f} ms/iter "
                     f"(host loop incl. reference)")
    lines.append(f"kernel calls: {stats.snapshot()}")
    return lines


def _serve(args) -> int:
    """OpenAI-compatible HTTP server over the engine (api_server.py)."""
    from .entrypoints.openai.api_server import serve_main

    return serve_main(args)


def _bench_serve(args) -> int:
    """Load generator against a running server (bench_serve.py)."""
    from .benchmarks.serve import bench_serve_main

    return bench_serve_main(args)


def build_parser(more: Sequence[Callable] = ()) -> argparse.ArgumentParser:
    """serving's subcommands; each of `more` adds its own to the subparsers (the `tune` of the whole
    command, tp_overlap_plugin/tuning/cli.py)."""
    p = Parser(prog="tp-overlap", description="tensor-parallel serving with overlapped kernels")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser("demo", help="symmetric heap + all-reduce across --tp local ranks")
    d.add_argument("--tp", type=int, default=2, help="number of ranks")
    d.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present")
    d.add_argument("--numel", type=int, default=4097, help="elements per all-reduce")
    d.add_argument("--iters", type=int, default=3, help="all-reduces per dtype")
    d.add_argument("--heap-size", type=int, default=64 << 20, help="symmetric heap bytes per rank")
    d.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are killed")
    add_debug_arg(d)
    d.set_defaults(func=_demo)

    for add in more:
        add(sub)

    # The server's and the benchmark's options live next to their code. Those modules import fastapi,
    # prometheus_client and httpx only when serving, so the parser works without the `serve` extra.
    from .entrypoints.openai.api_server import add_server_args
    from .benchmarks.offline import add_bench_offline_subcommands
    from .benchmarks.serve import add_bench_serve_args

    add_generate_subcommand(sub)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the built-in demo model)")
    add_engine_args(s)
    add_server_args(s)
    add_debug_arg(s)
    s.set_defaults(func=_serve)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    bs = bsub.add_parser("serve", help="load test a running OpenAI-compatible server (like `vllm bench serve`)")
    add_bench_serve_args(bs)
    add_debug_arg(bs)
    bs.set_defaults(func=_bench_serve)
    add_bench_offline_subcommands(bsub)
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


def main(argv=None, more: Sequence[Callable] = ()) -> int:
    _interpret_kernels_without_gpu(argv)
    args = build_parser(more).parse_args(argv)
    prog = " ".join(["tp-overlap", args.command] + ([args.bench_command] if args.command == "bench" else []))
    return _run(args, prog)


if __name__ == "__main__":
    sys.exit(main())
