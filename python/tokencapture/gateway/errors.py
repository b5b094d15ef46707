"""The gateway's HTTP errors: OpenAI-style JSON bodies with a status."""

from __future__ import annotations

import errno
from collections.abc import Mapping

import orjson
from starlette.responses import Response

__all__ = ["OUT_OF_DESCRIPTORS_HEADERS", "HttpError", "error_response", "out_of_descriptors"]


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    headers: Mapping[str, str] | None = None,
) -> Response:
    """`{"error": {"message", "type", "code"}}` with `status`."""
    body = {"error": {"message": message, "type": kind, "code": status}}
    return Response(
        orjson.dumps(body), status, headers=dict(headers or {}), media_type="application/json"
    )


class HttpError(Exception):
    """A request the gateway answers with `status` (and the message) instead of a result."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.headers = dict(headers or {})

    def response(self, headers: Mapping[str, str] | None = None) -> Response:
        return error_response(
            self.status, self.message, self.kind, {**self.headers, **(headers or {})}
        )


# A 503 for want of descriptors also closes its connection: when the process is out of them,
# idle client sockets are what holds them, and the client retries on a new one.
OUT_OF_DESCRIPTORS_HEADERS = {"connection": "close", "retry-after": "1"}


def out_of_descriptors(exc: BaseException) -> bool:
    """Whether `exc` is an open that ran out of descriptors (`EMFILE`, `ENFILE`)."""
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)
