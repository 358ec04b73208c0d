"""The ways in from outside the process: `openai/` is the OpenAI-compatible HTTP server. The
`tp-overlap` command itself (serving/cli.py, serving/args.py) stays at the package's top level.

An entrypoint may import the engine's front end (`serving.engine`: AsyncLLM, LLM, InputProcessor and
the output types), `serving.config`, `serving.args` and `serving.metrics`; never the worker or the
model, which it reaches only through the engine. Nothing below imports an entrypoint.
"""
