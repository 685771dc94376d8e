"""Errors answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

A bad request is a ``RequestError`` with its HTTP status. lucidlm's own errors (generate's
checks: ``temperature=-1 is invalid: expected a finite number >= 0.``) are bad requests too;
``as_request_error`` names the request's field in them where generate's option has another
name (``max_new_tokens`` is the request's ``max_tokens``).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from lucidlm.errors import LucidLMError

# A check's message begins with what it checked: "temperature=-1 is invalid", "logit_bias names token id ..."
_NAMED = re.compile(r"^([A-Za-z_]+)(?=[=\[ ])")


class RequestError(LucidLMError):
    """A request refused with ``status`` (400 bad field, 404, 405, 413, ...); ``param`` is the
    field at fault, as OpenAI names it, or None."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def as_request_error(exc: LucidLMError, fields: Mapping[str, str] = {}) -> RequestError:
    """``exc`` as a 400; ``fields`` maps the names generate's checks use to the request's fields
    that gave them (``{"max_new_tokens": "max_tokens", "temperature": "temperature"}``), so the
    message and ``param`` say what the client wrote."""
    if isinstance(exc, RequestError):
        return exc
    message = str(exc)
    match = _NAMED.match(message)
    if match is None or match.group(1) not in fields:
        return RequestError(message)
    param = fields[match.group(1)]
    return RequestError(param + message[match.end():], param=param)


def server_error(exc: BaseException) -> RequestError:
    """A bug, answered as a 500 that says what went wrong (the server goes on)."""
    return RequestError(f"internal error ({type(exc).__name__}: {exc}); this is a bug in lucidlm serve, the server "
                        f"logged its traceback", status=500, kind="server_error")
