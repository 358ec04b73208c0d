"""The engine: a front end (tokenizer, text) over an engine core (token ids, the ranks), as vLLM v1
splits it (serving/README.md draws the layering):

    llm.py              LLM: offline batches, over an LLMEngine
    llm_engine.py       LLMEngine: the front end over an engine core in this process
    async_llm.py        AsyncLLM: streams for servers; the front end over a core in its own process
    front_end.py        FrontEnd, shared by both: the tokenizer, input processing, request streams
    input_processor.py  validate and tokenize a request once -> ProcessedRequest
    request_stream.py   RequestStream: token-id deltas -> text, stop strings, RequestOutput
    outputs.py          RequestOutput, CompletionOutput: what callers read
    core_client.py      the front end's end of the core process: pipes, a reader thread
    core_process.py     the core process: its loop around one EngineCore
    core.py             EngineCore: scheduler, block manager, the ranks (serving/worker/workers.py); ids -> deltas
    messages.py         the types that cross between front end and core
    scheduler.py        continuous batching, chunked prefill, preemption
    block_manager.py    refcounted KV blocks
    structured.py       grammars through xgrammar, the batched token bitmask
    step_trace.py       the step timeline (TP_OVERLAP_STEP_TRACE)

An engine module may import `serving.worker` (the ranks, the runner, the step message),
`serving.model` (sampler state, tokenizers) and `serving.config`; never an entrypoint
(`serving.entrypoints`), a benchmark or the command. Import the names from their modules;
`tp_overlap_plugin.serving` exports the public ones lazily.
"""
