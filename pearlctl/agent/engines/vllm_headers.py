"""An ASGI middleware the agent loads into every vLLM server it starts (``--middleware``): each answer on
``/v1/*`` says which worker served it and on which weights, in the response headers ``X-Pearl-Worker``
(the URL the agent reports for the worker, from ``PEARL_WORKER_URL``) and ``X-Pearl-Weight-Version`` (the
label the agent last set with ``/update_weight_version``, read from the engine when the answer starts; left
out while the engine still has vLLM's placeholder label ``default``: nothing named its weights yet).

The run's router passes response headers through, so the gateway (pearlctl.router.gateway) tags every
part of a continued sequence with the worker and weights that produced it — vLLM's OpenAI answers carry
neither. For a stream the version is the one at its start; a weight update during a stream pauses the
engine first (pearlctl.agent.engines.vllm), so a part does not span two versions.

Runs inside the vLLM server process: it imports nothing of vLLM, and never fails a request — a header it
cannot compute is left out.
"""

from __future__ import annotations

import os

WORKER_HEADER = b"x-pearl-worker"
VERSION_HEADER = b"x-pearl-weight-version"
UNSET_VERSION = "default"  # what vLLM's engine reports until /update_weight_version is called


class PearlHeaders:
    def __init__(self, app):
        self.app = app
        self.worker = os.environ.get("PEARL_WORKER_URL", "").encode()

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message):
            if message.get("type") == "http.response.start":
                headers = list(message.get("headers") or [])
                if self.worker:
                    headers.append((WORKER_HEADER, self.worker))
                version = await _weight_version(scope)
                if version:
                    headers.append((VERSION_HEADER, version.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def _weight_version(scope) -> str | None:
    try:
        engine = scope["app"].state.engine_client
        version = await engine.get_weight_version()
    except Exception:  # an engine without weight versions, or one shutting down: no header
        return None
    # vLLM's label before anything set one: it names no weights (the gateway then uses the membership's)
    return str(version) if version not in (None, "", UNSET_VERSION) else None
