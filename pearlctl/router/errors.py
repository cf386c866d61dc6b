"""How a request to the gateway fails, as the caller sees it: each failure is one exception the app answers with
an OpenAI-shaped JSON error (``{"error": {"message", "type", "code", ...}}``), never a silent drop.

- `Refused`: the request's own fault as vllm-router or a worker said it (an upstream 4xx other than 408/429,
  `is_refusal`): passed through as is, status and body, never retried;
- `GiveUp`: no worker completed the turn within its retry window (pearlctl.router.turn, ``Turn.give_up``): 503;
- `BadRequest`: the gateway's own refusal of a request it cannot parse, or a membership change it could not make.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

RETRYABLE_4XX = (408, 429)


def error(status: int, message: str, kind: str, **extra: Any) -> JSONResponse:
    """An OpenAI-shaped error answer: ``{"error": {"message", "type", "code", ...}}``."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status, **extra}}, status)


def is_refusal(status: int) -> bool:
    """Whether an upstream status is the request's own fault (not retried): a 4xx but 408 and 429."""
    return 400 <= status < 500 and status not in RETRYABLE_4XX


class Refused(Exception):
    """The request's own fault (an upstream 4xx): passed through as is."""

    def __init__(self, status: int, body: bytes, media_type: str | None):
        super().__init__(f"HTTP {status}")
        self.status, self.body, self.media_type = status, body, media_type

    def response(self) -> Response:
        return Response(self.body, self.status, media_type=self.media_type or "application/json")


class GiveUp(Exception):
    """A turn's retry window passed without a complete answer; ``doc`` is the 503's error document."""

    def __init__(self, doc: dict):
        super().__init__(doc["message"])
        self.doc = doc

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.doc}, 503)


class BadRequest(Exception):
    """Answered with ``status`` and the message, as an ``invalid_request_error``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
