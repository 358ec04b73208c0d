"""The two bases of the API's schemas: a request ignores what it does not list (as vLLM does: a client
that sends whole vLLM or OpenAI request objects keeps working), in strict mode (`"10"` is no integer, as
in the OpenAI API), and takes no NaN or Infinity; a response lists exactly what it sends.

An ignored field is logged at warning level the first time its name comes (per request model), then at
debug level: a client sending it with every request would otherwise fill the log. Fields that would change
the output in a way this server cannot honour are not unknown: the models list them and refuse their other
values with a 400 naming them (protocol_vllm_fields.py, protocol.py)."""

from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

logger = logging.getLogger("tp_overlap.server")

# Every request model: unknown fields are dropped (and logged), no type coercion ("10" is no integer), and
# allow_inf_nan=False because Python's JSON reader takes NaN and Infinity: a client that sends them gets
# "must be a finite number", not a range error that NaN fails by accident.
REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

# Names remembered for "log once"; past this many, new names are logged at debug level only, so that a
# client inventing names cannot grow the set (or the log) without bound.
MAX_REMEMBERED_IGNORED = 1024


class _IgnoredLog:
    """Which (model, field name) pairs were already logged as ignored."""

    def __init__(self):
        self.seen: set[tuple[str, str]] = set()
        self.lock = threading.Lock()

    def first_time(self, model: str, names: list[str]) -> list[str]:
        with self.lock:
            new = [n for n in names if (model, n) not in self.seen]
            room = max(0, MAX_REMEMBERED_IGNORED - len(self.seen))
            self.seen.update((model, n) for n in new[:room])
            return new[:room]


IGNORED_LOG = _IgnoredLog()


class RequestModel(BaseModel):
    model_config = REQUEST_CONFIG
    # The names (and aliases) a model knows, per class, filled on first use.
    _known: ClassVar[dict[type, frozenset[str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _log_ignored_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = RequestModel._known.get(cls)
            if known is None:
                known = frozenset(n for name, f in cls.model_fields.items() for n in (name, f.alias) if n)
                RequestModel._known[cls] = known
            unknown = sorted(str(k) for k in data if k not in known)
            if unknown:
                new = IGNORED_LOG.first_time(cls.__name__, unknown)
                if new:
                    logger.warning("%s: ignoring the unknown field%s %s (this server does not use %s; logged "
                                   "once per field name)", cls.__name__, "s" if len(new) > 1 else "",
                                   ", ".join(repr(n[:80]) for n in new), "them" if len(new) > 1 else "it")
                logger.debug("%s: ignored fields %s", cls.__name__, unknown)
        return data


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Checks two request models make alike, called from their validators.
def stream_options_need_stream(req):
    """A request's stream_options come only with stream true (its model's validator; returns the request)."""
    if req.stream_options is not None and not req.stream:
        raise ValueError("stream_options is only allowed when stream is true")
    return req


def schema_iff_json_schema(kind: str, schema: Any, field: str, missing: str) -> None:
    """A structured-output format's schema (its `field`) comes with type 'json_schema' and with no other
    type; `missing`: the error when it does not come. Chat's response_format and the Responses API's
    text.format say so alike."""
    if kind == "json_schema" and schema is None:
        raise ValueError(missing)
    if kind != "json_schema" and schema is not None:
        raise ValueError(f"'{field}' is only allowed with type 'json_schema', not {kind!r}")
