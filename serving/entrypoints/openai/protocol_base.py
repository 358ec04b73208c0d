"""The two bases of the API's schemas: a request refuses what it does not list, in strict mode (`"10"` is
no integer, as in the OpenAI API); a response lists exactly what it sends."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
