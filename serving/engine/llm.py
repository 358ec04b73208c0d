"""`LLM`: the offline batch API over an `LLMEngine` (front end and engine core) in this process."""

from __future__ import annotations

from typing import Optional, Sequence as Seq, Union

from ..config import EngineConfig, RequestError, SamplingParams
from .input_processor import Prompt
from .llm_engine import LLMEngine
from .outputs import RequestOutput


class LLM:
    """Offline batch API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, config: Optional[EngineConfig] = None, **kwargs):
        self.engine = LLMEngine(config, **kwargs)

    @property
    def is_driver(self) -> bool:
        return self.engine.is_driver

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Seq[Prompt]],
                 sampling_params: Union[None, SamplingParams, dict, Seq[SamplingParams]] = None,
                 ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
            plist = list(sampling_params)
        else:
            plist = [sampling_params] * len(prompts)
        requests = []   # all of them processed before any is added: a bad one adds none
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            try:
                requests.append(self.engine.process_request(p, sp))
            except RequestError:   # about the sampling parameters, not this prompt
                raise
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from e
        ids = [self.engine.add(None, r) for r in requests]
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for rid in ids:
                if rid not in final:
                    self.engine.abort_request(rid)
            raise
        return [final[rid] for rid in ids]

    def chat(self, conversations, sampling_params=None) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
