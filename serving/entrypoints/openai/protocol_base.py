"""The two bases of the API's schemas: a request refuses what it does not list, in strict mode (`"10"` is
no integer, as in the OpenAI API), and takes no NaN or Infinity; a response lists exactly what it sends."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


# Every request model: unknown fields are a 400 naming them, no type coercion ("10" is no integer), and
# allow_inf_nan=False because Python's JSON reader takes NaN and Infinity: a client that sends them gets
# "must be a finite number", not a range error that NaN fails by accident.
REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class RequestModel(BaseModel):
    model_config = REQUEST_CONFIG


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
