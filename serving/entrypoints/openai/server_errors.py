"""The server's errors: OpenAI's body `{"error": {"message", "type", "param", "code"}}` for every failure,
and the messages of a request that does not validate, each naming the field the client sent.

400 for invalid requests (never FastAPI's 422), 401 for a missing or wrong API key, 404 for an unknown
model or route, 500 when the engine fails a request, 503 while the server shuts down."""

from __future__ import annotations

from typing import Any, Optional, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from .chat_messages import MESSAGE_TAGS
from .protocol import ErrorInfo, ErrorResponse
from .protocol_responses import ITEM_TAGS

ERROR_RESPONSES: dict[Union[int, str], dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    500: {"model": ErrorResponse, "description": "the engine failed this request"},
}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
                503: "service_unavailable_error"}


# The API's name of a SamplingParams field, where the two differ.
API_PARAM = {"structured_output": "response_format"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _printable(text: Optional[str]) -> Optional[str]:
    # An error may quote what the client sent; text that cannot be encoded would fail the error response.
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[Union[str, int]] = None) -> dict:
    message, param = _printable(message), _printable(param)
    info = ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "invalid_request_error"), param=param,
                     code=code if code is not None else status)
    return ErrorResponse(error=info).model_dump()


def internal_error_body(exc: BaseException) -> dict:
    """The 500 of an exception that no handler expected."""
    return error_body(500, f"internal server error: {type(exc).__name__}: {exc}", code="internal_error")


def error_response(status: int, message: str, param: Optional[str] = None,
                   code: Optional[Union[str, int]] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _clean_loc(loc) -> list[str]:
    # pydantic names the union branch it tried in the location (`content.str`, `prompt.list[int]`), and
    # a message's role or an item's type after its index (`messages.0.user.content`, `input.0.message.content`);
    # a client wants the field it sent.
    out, after_index = [], False
    for x in loc:
        tagged, after_index = after_index and out[-2:-1] in (["messages"], ["content"], ["input"]), isinstance(x, int)
        x = str(x)
        if x == "body" and not out:
            continue
        if x in _UNION_TAGS or "[" in x or (tagged and x in MESSAGE_TAGS | ITEM_TAGS):
            continue
        out.append(x)
    return out


def describe_validation_errors(errors) -> tuple[str, Optional[str]]:
    """(message, param) from pydantic / FastAPI errors, naming the field and what is wrong with it."""
    by_param: dict[Optional[str], dict] = {}
    for e in errors:
        param = ".".join(_clean_loc(e.get("loc", ()))) or None
        seen = by_param.get(param)
        # Of the errors one union field collects (one per branch), the validator's own message is the
        # one that explains the problem.
        if seen is None or (e.get("type") == "value_error" and seen.get("type") != "value_error"):
            by_param[param] = e
    # A union field fails once per branch: at the field itself (`"content": 5` is no string) and deeper
    # (inside the list branch). When a deeper error exists, it is the informative one.
    deeper = {p for p in by_param if p and any(q and q.startswith(p + ".") for q in by_param)}
    parts, first_param = [], None
    for param, e in by_param.items():
        if param in deeper:
            continue
        kind = e.get("type", "")
        if kind == "json_invalid":
            ctx = e.get("ctx") or {}
            msg = f"the request body is not valid JSON ({ctx.get('error', e.get('msg'))})"
            param = None
        elif kind == "extra_forbidden":
            msg = f"unsupported parameter '{param}': this server does not implement it"
        elif kind == "missing" and param is None:
            msg = "the request body is empty; send a JSON object"
        elif kind == "missing":
            msg = f"missing required parameter '{param}'"
        elif kind == "model_attributes_type" and param is None:
            msg = "the request body must be a JSON object"
        elif kind == "finite_number":
            msg = f"{param} must be a finite number, not {e.get('input')!r}"
        else:
            msg = e.get("msg", "invalid value").removeprefix("Value error, ")
            if param:
                msg = f"invalid value for '{param}': {msg}"
        if first_param is None:
            first_param = param
        if msg not in parts:
            parts.append(msg)
    if not parts:
        return "invalid request", None
    more = f" (and {len(parts) - 3} more errors)" if len(parts) > 3 else ""
    return "; ".join(parts[:3]) + more, first_param


def is_json_media_type(ctype: str) -> bool:
    media = ctype.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _unencodable_field(value: Any, path: tuple = ()) -> Optional[tuple[str, str]]:
    """(field path, offending text) of the first string in a parsed request that is not valid Unicode.

    JSON's `\\ud800` escapes decode to lone surrogates, which no tokenizer can encode; found here, they are
    a 400 naming the field instead of an encoding error deep in the tokenizer."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return ".".join(map(str, path)), value[e.start:e.end]
        return None
    if isinstance(value, BaseModel):
        items = ((k, getattr(value, k)) for k in type(value).model_fields)
    elif isinstance(value, dict):
        items = [(k, k) for k in value] + list(value.items())   # keys are text too
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        hit = _unencodable_field(v, (*path, k))
        if hit is not None:
            return hit
    return None


def check_encodable(req: BaseModel) -> None:
    hit = _unencodable_field(req)
    if hit is not None:
        param, bad = hit
        raise ApiError(400, f"invalid value for '{param}': the text is not valid Unicode (it holds the lone "
                            f"surrogate {bad.encode('unicode_escape').decode()}); send UTF-8 text", param=param)


