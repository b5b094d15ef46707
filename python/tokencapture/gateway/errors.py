"""The gateway's HTTP errors: OpenAI-style JSON bodies with a status."""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from starlette.responses import Response

__all__ = ["HttpError", "error_response"]


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

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind

    def response(self, headers: Mapping[str, str] | None = None) -> Response:
        return error_response(self.status, self.message, self.kind, headers)
