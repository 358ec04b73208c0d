"""The engine, from a request to the ranks' runners (serving/README.md draws the layering):

    llm.py              LLM: offline batches, in this process
    async_llm.py        AsyncLLM: streams for servers; per-request state on the request side
    input_processor.py  validate and tokenize a request once -> ProcessedRequest
    core_client.py      the client's end of the engine core: pipes, a reader thread
    core_process.py     the core process: its loop around one LLMEngine
    llm_engine.py       LLMEngine: scheduler, block manager, the ranks (serving/worker/workers.py); steps -> deltas
    outputs.py          OutputDelta per request per step; RequestOutput, rebuilt by RequestStream
    messages.py         the types that cross between request side and core
    scheduler.py        continuous batching, chunked prefill, preemption
    block_manager.py    refcounted KV blocks
    structured.py       grammars through xgrammar, the batched token bitmask
    step_trace.py       the step timeline (TP_OVERLAP_STEP_TRACE)

An engine module may import `serving.worker` (the ranks, the runner, the step message),
`serving.model` (sampler state, tokenizers) and `serving.config`; never an entrypoint
(`serving.entrypoints`), a benchmark or the command. Import the names from their modules;
`tp_overlap_plugin.serving` exports the public ones lazily.
"""
