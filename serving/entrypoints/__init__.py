"""The ways in from outside the process: `openai/` is the OpenAI-compatible HTTP server, and
server_process.py runs it as `tp-overlap serve` in a subprocess (for tests and bench/ tools). The
`tp-overlap` command itself is the package's top floor (tp_overlap_plugin/cli/), which hands the server
its typed configs.

An entrypoint may import the engine's front end (`serving.engine`: AsyncLLM, LLM, InputProcessor and
the output types), `serving.config`, `serving.user_errors` and `serving.metrics`; never the worker or
the model, which it reaches only through the engine. Nothing below imports an entrypoint.
"""
