"""The server under load, stock vs `--tp-overlap`, in one run: for each variant start
`tp-overlap serve`, wait for /health, run `tp-overlap bench serve` at each concurrency, shut the
server down with SIGINT (the graceful path users hit), and go on to the next.

    python bench/serve_load.py --model llama-3-8b --tp 2                  # GPUs
    python bench/serve_load.py --model demo --tp 2 --quick                # a logic check on the CPU

JSON + markdown + PNG in bench/results/ (serve-<model>-tp<N>-<device>-<date>).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bench_parser, environment, grouped_bars, md_table, write_results  # noqa: E402


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the server at {url} was not healthy after {timeout:.0f} s")


def load(port: int, concurrency: int, num_prompts: int, input_len: int, output_len: int, label: str) -> dict:
    from tp_overlap_plugin.serving.bench_serve import add_bench_serve_args, run_benchmark
    p = argparse.ArgumentParser()
    add_bench_serve_args(p)
    a = p.parse_args(["--port", str(port), "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
                      "--random-input-len", str(input_len), "--random-output-len", str(output_len),
                      "--label", label, "--seed", str(concurrency)])
    return asyncio.run(run_benchmark(a))


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--startup-timeout", type=float, default=400)
    args = p.parse_args(argv)
    levels = [1, 4] if args.quick else [int(c) for c in args.concurrency.split(",")]
    in_len, out_len = (16, 8) if args.quick else (args.input_len, args.output_len)
    url = f"http://127.0.0.1:{args.port}"
    flags = ("stock",) if args.tp == 1 else ("stock", "overlap")
    results: dict[str, list[dict]] = {}
    errors = []
    for flag in flags:
        cmd = [sys.executable, "-m", "tp_overlap_plugin.cli", "serve", "--model", args.model, "--tp", str(args.tp),
               "--port", str(args.port), "--max-model-len", str(max(2048, 2 * (in_len + out_len)))]
        if args.model != "demo":
            cmd += ["--load-format", "dummy"]
        if flag == "overlap":
            cmd.append("--tp-overlap")
        print("[serve_load]", " ".join(cmd), flush=True)
        proc = subprocess.Popen(cmd)
        try:
            wait_healthy(url, proc, args.startup_timeout)
            results[flag] = []
            for c in levels:
                res = load(args.port, c, max(4 * c, 8), in_len, out_len, f"{flag} c={c}")
                print(f"[serve_load] {flag} c={c}: {res['output_throughput']:.1f} out tok/s, "
                      f"TTFT {res['median_ttft_ms']:.1f} ms, TPOT {res['median_tpot_ms']:.2f} ms, "
                      f"failed {res['failed']}", flush=True)
                results[flag].append(res)
        except Exception as e:
            errors.append(f"{flag}: {e!r}")
            print("[serve_load]", errors[-1], flush=True)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                errors.append(f"{flag}: the server did not exit within 120 s of SIGINT")
    rows = []
    for i, c in enumerate(levels):
        row = [c]
        for flag in flags:
            r = results.get(flag, [])
            r = r[i] if i < len(r) else None
            row += [r["output_throughput"], r["median_ttft_ms"], r["median_tpot_ms"], r["p99_itl_ms"], r["failed"]] \
                if r else ["-"] * 5
        if len(flags) == 2 and all(isinstance(row[k], float) for k in (1, 6)):
            row.append(row[6] / row[1])
        rows.append(row)
    headers = ["concurrency"]
    for flag in flags:
        headers += [f"{flag} out tok/s", f"{flag} TTFT ms", f"{flag} TPOT ms", f"{flag} p99 ITL ms", f"{flag} failed"]
    if len(flags) == 2:
        headers.append("overlap/stock")
    md = (f"`tp-overlap bench serve`, random prompts {in_len} in / {out_len} out, 4 x concurrency requests "
          f"(at least 8) per level, medians.\n\n" + md_table(headers, rows))
    if errors:
        md += "\n## Errors\n\n" + "\n".join(f"- {e}" for e in errors) + "\n"
    env = environment(args.tp, on_gpu=torch.cuda.is_available(), model=args.model, input_len=in_len, output_len=out_len)
    paths = write_results(args.out, f"serve-{args.model}-tp{args.tp}", {"environment": env, "results": results,
                                                                         "errors": errors}, md)
    grouped_bars(paths[0].replace(".json", ".png"), [f"c={c}" for c in levels],
                 {flag: [r["output_throughput"] for r in results.get(flag, [])] for flag in flags},
                 "output tokens/s (HTTP)", rotation=0)
    print(md)
    print("wrote", *paths)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
