"""Light serving engine (imported as tp_overlap_plugin.serving).

    from tp_overlap_plugin.serving import LLM, SamplingParams
    llm = LLM(model="demo")                      # built-in tiny model, nothing downloaded
    print(llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text)

Its folders are floors, each importing only the ones below (serving/README.md, Layering):
entrypoints/ and benchmarks/ > engine/ > worker/ > model/ > config.py; integration_tests/
test_serving_floors.py holds them to it.
"""

from __future__ import annotations

import importlib

# Resolved on first use: the `tp-overlap` command (tp_overlap_plugin/cli/) has to set TRITON_INTERPRET before
# anything imports Triton, and the engine imports Triton through the kernels. An eager import here
# would run before the command's first line.
_EXPORTS = {"EngineConfig": ".config", "ModelConfig": ".config", "SamplingParams": ".config",
            "StructuredOutput": ".config",
            "LLM": ".engine.llm", "AsyncLLM": ".engine.async_llm", "LLMEngine": ".engine.llm_engine",
            "RequestOutput": ".engine.outputs", "CompletionOutput": ".engine.outputs"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
