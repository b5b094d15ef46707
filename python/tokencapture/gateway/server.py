"""Run the gateway under uvicorn (what `tokencapture gateway` calls)."""

from __future__ import annotations

import ipaddress
import logging
import os
from typing import Any

import uvicorn

from tokencapture.gateway.app import DEFAULT_MAX_BODY_BYTES, GatewayConfig, create_app
from tokencapture.gateway.backend import open_backend

__all__ = ["TOKEN_ENV", "serve"]

TOKEN_ENV = "TOKENCAPTURE_GATEWAY_TOKEN"
logger = logging.getLogger("tokencapture.gateway")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    *,
    upstream: str,
    store_dir: str | None = None,
    dsn: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    tito: bool = False,
    tokenizer: str | None = None,
    renderer: str = "qwen3",
    timeout: float = 600.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "warning",
) -> None:
    """Serve a gateway until interrupted. A non-loopback `host` without a token is refused."""
    if not upstream.startswith(("http://", "https://")):
        raise ValueError(f"--upstream {upstream!r}: give the engine's root URL, http(s)://...")
    if upstream.rstrip("/").endswith("/v1"):
        raise ValueError(
            f"--upstream {upstream!r}: give the engine's root URL (the gateway adds /v1/...)"
        )
    token = token or os.environ.get(TOKEN_ENV) or None
    if not _is_loopback(host) and token is None:
        raise ValueError(
            f"--host {host}: the gateway binds beyond loopback only with a bearer token "
            f"(--token or {TOKEN_ENV})"
        )
    bridge: Any = None
    if tito:
        if tokenizer is None:
            raise ValueError("--tito needs --tokenizer DIR (the engine's tokenizer.json)")
        from tokencapture.gateway.tito import Bridge

        bridge = Bridge.from_tokenizer_dir(tokenizer, renderer)
    backend = open_backend(store_dir=store_dir, dsn=dsn)
    app = create_app(
        backend,
        GatewayConfig(
            upstream, token=token, timeout=timeout, max_body_bytes=max_body_bytes, tito=bridge
        ),
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        # Nothing here reads the client's address or scheme, so X-Forwarded-* need no
        # middleware rewriting every request's scope; nor does any client need a Server header.
        proxy_headers=False,
        server_header=False,
        timeout_graceful_shutdown=10,
    )
