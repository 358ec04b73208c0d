"""The OpenAI-compatible server: the app and its routes (api_server.py), the request and response
schema (protocol.py), one handler per API (serving_completion.py, serving_chat.py,
serving_tokenization.py over serving_base.py), OpenAI's error bodies (server_errors.py), the ASGI
middlewares (server_middleware.py), the graceful shutdown (server_shutdown.py) and log-probabilities in
each API's shape (server_logprobs.py).

It may import the engine's front end (`serving.engine.async_llm`, `input_processor`, `outputs`),
`serving.config`, `serving.user_errors` and `serving.metrics`, and FastAPI / uvicorn / pydantic; never
the worker or the model. Only the command (tp_overlap_plugin/cli/) imports it.
"""
