"""The capture gateway: an OpenAI-compatible proxy that records every call's exact tokens.

Point any agent or RL framework at `http://127.0.0.1:PORT/rollouts/<rollout_id>/v1` (or send
`X-Rollout-Id` to `/v1/...`); the gateway forwards to a vLLM-compatible engine, stores each
call's `TokenEntry` durably (a `TokenCaptureStore` directory or a PostgreSQL database) before it
releases the answer, and resolves each continuation's parent. Trainers read the same directory
or DSN with the store API. See docs/gateway.md.

Needs the `gateway` extra: `pip install 'tokencapture[gateway]'` (Starlette, uvicorn, aiohttp;
and `renderers` for token-in-token-out, `--tito`). Nothing else in tokencapture imports this
package.
"""

from __future__ import annotations

try:
    import aiohttp  # noqa: F401
    import starlette  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f"the capture gateway needs the 'gateway' extra ({exc.name} is missing): "
        "pip install 'tokencapture[gateway]'"
    ) from exc

from tokencapture.gateway.app import DEFAULT_MAX_BODY_BYTES, Gateway, GatewayConfig, create_app
from tokencapture.gateway.backend import Backend, open_backend
from tokencapture.gateway.capture import DIVERGED_REASON

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DIVERGED_REASON",
    "Backend",
    "Gateway",
    "GatewayConfig",
    "create_app",
    "open_backend",
]
