"""The `tp-overlap bench` subcommands: `bench serve` (serve.py), a load generator against any
OpenAI-compatible server over HTTP, and the offline `bench latency` / `bench throughput` (offline.py)
over `LLM`; workloads.py draws the long-tailed request lengths both use.

A benchmark takes a typed config (serve_config.py's BenchServeConfig, offline.py's OfflineBenchConfig)
and may import `serving.engine` (LLM), `serving.config` and `serving.user_errors`; serve.py imports
nothing of the engine (it only speaks HTTP). Only the command (tp_overlap_plugin/cli/) and bench/
scripts import it.
"""
