"""The `tp-overlap bench` subcommands: `bench serve` (serve.py), a load generator against any
OpenAI-compatible server over HTTP, and the offline `bench latency` / `bench throughput` (offline.py)
over `LLM`; workloads.py draws the long-tailed request lengths both use.

A benchmark may import `serving.engine` (LLM), `serving.config` and `serving.args`; serve.py imports
nothing of the engine (it only speaks HTTP). Only the command (serving/cli.py) and bench/ scripts
import it.
"""
