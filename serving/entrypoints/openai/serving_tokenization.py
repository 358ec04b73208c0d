"""POST /tokenize and /detokenize, in vLLM's request and response shapes."""

from __future__ import annotations

from .protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from .server_errors import ApiError
from .serving_base import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if req.prompt is not None:
            ids = self._encode(req.prompt, req.add_special_tokens is not False)
        else:
            tools = [t.for_template() for t in req.tools] if req.tools else None
            # what /v1/chat/completions feeds the model
            ids = self._chat_ids([m.for_template() for m in req.messages], req.add_generation_prompt, tools,
                                 req.continue_final_message, req.chat_template_kwargs, req.chat_template,
                                 req.add_special_tokens)
        strs = [self.tokenizer.decode([t]) for t in ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", param="tokens")
        vocab = self.engine.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens[{bad}] = {req.tokens[bad]} is outside the vocabulary [0, {vocab})",
                           param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))
