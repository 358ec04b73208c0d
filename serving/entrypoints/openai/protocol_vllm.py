"""vLLM's request extensions that both endpoints take (guided decoding, min_tokens, skip_special_tokens,
prompt_logprobs, request_id; the fields of issue 54 in protocol_vllm_fields.py). The endpoint-specific ones (`best_of` above n, chat's `echo`,
`continue_final_message`, `chat_template_kwargs`) are in protocol.py beside their endpoint. vLLM's protocol gave the semantics; serving/README.md lists them."""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_validator

from ...config import MAX_TOP_LOGPROBS
from .protocol_base import RequestModel
from .protocol_vllm_fields import VllmRequestFields, neutral_only

# A request id a client chooses is echoed in the X-Request-Id header: printable ASCII, bounded.
MAX_REQUEST_ID_CHARS = 256


class StructuredOutputsParams(RequestModel):
    """vLLM's `structured_outputs` object: exactly one constraint, and vLLM's options."""

    json_: Optional[Union[str, dict[str, Any]]] = Field(None, alias="json", description="a JSON schema")
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = Field(None, description="EBNF (xgrammar's dialect, root rule `root`)")
    # JSON is always generated compact here (xgrammar without free whitespace), which both values allow.
    disable_any_whitespace: Optional[bool] = Field(None, description="JSON without whitespace between its tokens: "
                                                   "what this server generates either way")
    # vLLM applies it to its guidance backend only, to match xgrammar, whose strict mode (used here) allows no
    # property the schema does not list.
    disable_additional_properties: Optional[bool] = Field(None, description="accepted (vLLM's guidance backend "
                                                          "only)")
    disable_fallback: Optional[bool] = Field(None, description="accepted: there is no other backend to fall back to")
    whitespace_pattern: neutral_only((), "JSON is generated compact here (xgrammar without free whitespace); a "
                                         "whitespace pattern cannot be applied", str) = None
    structural_tag: neutral_only((), "structural tags are not supported", str) = None

    @field_validator("json_")
    @classmethod
    def _json_schema(cls, v):
        return _schema(v)


def _schema(v: Optional[Union[str, dict]]) -> Optional[dict]:
    """vLLM takes a schema as an object or as its JSON text."""
    if v is None or isinstance(v, dict):
        return v
    try:
        out = json.loads(v)
    except ValueError as e:
        raise ValueError(f"a string that is not a JSON schema ({e})") from None
    if not isinstance(out, dict):
        raise ValueError("a JSON schema must be an object")
    return out


class VllmExtensions(VllmRequestFields):
    """vLLM's extensions that both endpoints take (the sampling ones are in SamplingParams too)."""

    guided_json: Optional[Union[str, dict[str, Any]]] = Field(None, description="a JSON schema the output follows")
    guided_regex: Optional[str] = Field(None, description="a regular expression the whole output matches")
    guided_choice: Optional[list[str]] = Field(None, description="the output is exactly one of these")
    guided_grammar: Optional[str] = Field(None, description="EBNF (xgrammar's dialect, root rule `root`)")
    structured_outputs: Optional[StructuredOutputsParams] = None
    min_tokens: int = Field(0, ge=0, description="no end-of-sequence, stop token or stop string before this many")
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the text")
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="each prompt token's "
                                           "log-probability and this many most likely alternatives")
    request_id: Optional[str] = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS,
                                      description="the response id becomes <prefix>-<request_id>; also the "
                                                  "X-Request-Id header (which, when sent, wins)")

    @field_validator("request_id")
    @classmethod
    def _printable_id(cls, v):
        if v is not None and not all("!" <= ch <= "~" for ch in v):
            raise ValueError("request_id must be printable ASCII without spaces (it is echoed in a header)")
        return v

    @field_validator("guided_json")
    @classmethod
    def _json_schema(cls, v):
        return _schema(v)

    @field_validator("guided_choice")
    @classmethod
    def _choices(cls, v):
        if v is not None and (not v or any(c == "" for c in v)):
            raise ValueError("guided_choice must be a non-empty list of non-empty strings")
        return v

    def structured_kinds(self) -> list[str]:
        """The fields that ask for a structured output (at most one may)."""
        kinds = [k for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                             "structured_outputs") if getattr(self, k) is not None]
        rf = getattr(self, "response_format", None)
        if rf is not None and rf.structured_output() is not None:
            kinds.append("response_format")
        return kinds

    @model_validator(mode="after")
    def _one_structure(self):
        kinds = self.structured_kinds()
        if len(kinds) > 1:
            raise ValueError(f"send one structured-output constraint, not {len(kinds)}: {', '.join(kinds)}")
        so = self.structured_outputs
        if so is not None:
            set_ = [k for k in ("json_", "json_object", "regex", "choice", "grammar") if getattr(so, k) not in
                    (None, False)]
            if len(set_) != 1:
                raise ValueError("structured_outputs needs exactly one of json, json_object, regex, choice and "
                                 f"grammar; got {', '.join(k.rstrip('_') for k in set_) or 'none'}")
            if so.choice is not None and (not so.choice or any(c == "" for c in so.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        return self

    def extension_structured_output(self) -> Optional[dict[str, Any]]:
        """The engine's StructuredOutput fields from guided_* / structured_outputs, or None."""
        so = self.structured_outputs
        if self.guided_json is not None:
            return {"json_schema": self.guided_json}
        if self.guided_regex is not None:
            return {"regex": self.guided_regex}
        if self.guided_choice is not None:
            return {"choice": list(self.guided_choice)}
        if self.guided_grammar is not None:
            return {"grammar": self.guided_grammar}
        if so is None:
            return None
        if so.json_ is not None:
            return {"json_schema": so.json_}
        if so.json_object:
            return {"json_object": True}
        if so.regex is not None:
            return {"regex": so.regex}
        if so.choice is not None:
            return {"choice": list(so.choice)}
        return {"grammar": so.grammar}


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`: keyed by token id."""

    logprob: float
    rank: int = Field(..., description="1 + the number of tokens more likely than this one")
    decoded_token: str


PromptLogprobs = list[Optional[dict[str, PromptLogprob]]]
