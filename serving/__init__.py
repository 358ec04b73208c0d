"""Light serving engine (imported as tp_overlap_plugin.serving).

    from tp_overlap_plugin.serving import LLM, SamplingParams
    llm = LLM(model="demo")                      # built-in tiny model, nothing downloaded
    print(llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text)
"""

from .config import EngineConfig, ModelConfig, SamplingParams
from .engine import LLM, AsyncLLM, CompletionOutput, LLMEngine, RequestOutput

__all__ = ["EngineConfig", "ModelConfig", "SamplingParams", "LLM", "AsyncLLM", "LLMEngine",
           "RequestOutput", "CompletionOutput"]
