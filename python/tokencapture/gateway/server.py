"""Run the gateway under uvicorn (what `tokencapture gateway` calls).

One process by default. With `workers=N` (`--workers N`), uvicorn's supervisor binds the
socket and runs N worker processes, each a whole gateway over the same store (which is safe
for many processes: every write takes the rollout's lock, and each process folds in what the
others wrote), and restarts a worker that dies. The settings reach the workers through the
environment (`SETTINGS_ENV`; the token through `TOKEN_ENV` and the engine's key through
`UPSTREAM_KEY_ENV`, as for one process: secrets stay out of the settings).
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress
import json
import logging
import os
import resource
from typing import Any

import uvicorn

from tokencapture.gateway.app import DEFAULT_MAX_BODY_BYTES, GatewayApp, GatewayConfig, create_app
from tokencapture.gateway.backend import open_backend

__all__ = [
    "SETTINGS_ENV",
    "TOKEN_ENV",
    "UPSTREAM_KEY_ENV",
    "app_from_environment",
    "log_config",
    "raise_descriptor_limit",
    "serve",
]

TOKEN_ENV = "TOKENCAPTURE_GATEWAY_TOKEN"
UPSTREAM_KEY_ENV = "TOKENCAPTURE_UPSTREAM_API_KEY"
SETTINGS_ENV = "TOKENCAPTURE_GATEWAY_SETTINGS"
logger = logging.getLogger("tokencapture.gateway")


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging configuration, with the gateway's and the store's loggers
    (`tokencapture.*`) on its stderr handler at `level`: the library gives them only a
    `NullHandler` (a library prints nothing its application did not ask for), and the gateway
    is an application whose failures an operator must see."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["tokencapture"] = {
        "handlers": ["default"],
        "level": level.upper(),
        "propagate": False,
    }
    return config


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _can_enter_cwd() -> bool:
    try:
        return os.access(os.getcwd(), os.X_OK)
    except OSError:  # removed since
        return False


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise this process's soft `RLIMIT_NOFILE` to its hard limit, as servers do (Go's runtime
    does it for every program); returns the soft limit before and after.

    Every client of the gateway holds a socket, and so does each call at the engine: under the
    common default soft limit of 1,024 a few hundred concurrent sessions would take every
    descriptor, and the store could then open nothing. The hard limit is the operator's bound
    and stays as it is; an unlimited one leaves the soft limit alone.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or (soft != resource.RLIM_INFINITY and soft >= hard):
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError) as exc:
        logger.warning("could not raise the descriptor limit from %d to %d: %s", soft, hard, exc)
        return soft, soft
    logger.info("descriptor limit raised from %d to %d", soft, hard)
    return soft, hard


def _app(settings: dict[str, Any], token: str | None, upstream_key: str | None) -> GatewayApp:
    """The gateway of `settings` (what `serve` was given, but the secrets and the bind)."""
    bridge: Any = None
    if settings["tito"]:
        from tokencapture.gateway.tito import Bridge

        bridge = Bridge.from_tokenizer_dir(settings["tokenizer"], settings["renderer"])
    backend = open_backend(store_dir=settings["store_dir"], dsn=settings["dsn"])
    return create_app(
        backend,
        GatewayConfig(
            settings["upstream"],
            token=token,
            timeout=settings["timeout"],
            max_body_bytes=settings["max_body_bytes"],
            tito=bridge,
            upstream_api_key=upstream_key,
        ),
    )


def app_from_environment() -> GatewayApp:
    """The gateway of one worker process of `serve(workers=N)` (a uvicorn app factory)."""
    raw = os.environ.get(SETTINGS_ENV)
    if raw is None:
        raise RuntimeError(f"{SETTINGS_ENV} is not set: start workers with serve(workers=N)")
    return _app(
        json.loads(raw),
        os.environ.get(TOKEN_ENV) or None,
        os.environ.get(UPSTREAM_KEY_ENV) or None,
    )


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
    workers: int = 1,
    log_level: str = "warning",
    upstream_api_key: str | None = None,
) -> None:
    """Serve a gateway until interrupted, in `workers` processes. A non-loopback `host`
    without a token is refused."""
    if not upstream.startswith(("http://", "https://")):
        raise ValueError(f"--upstream {upstream!r}: give the engine's root URL, http(s)://...")
    if upstream.rstrip("/").endswith("/v1"):
        raise ValueError(
            f"--upstream {upstream!r}: give the engine's root URL (the gateway adds /v1/...)"
        )
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers {workers!r}: a number of processes, at least 1")
    token = token or os.environ.get(TOKEN_ENV) or None
    upstream_api_key = upstream_api_key or os.environ.get(UPSTREAM_KEY_ENV) or None
    if not _is_loopback(host) and token is None:
        raise ValueError(
            f"--host {host}: the gateway binds beyond loopback only with a bearer token "
            f"(--token or {TOKEN_ENV})"
        )
    if tito and tokenizer is None:
        raise ValueError("--tito needs --tokenizer DIR (the engine's tokenizer.json)")
    settings = {
        "upstream": upstream,
        "store_dir": None if store_dir is None else os.path.abspath(store_dir),
        "dsn": dsn,
        "tito": tito,
        "tokenizer": None if tokenizer is None else os.path.abspath(tokenizer),
        "renderer": renderer,
        "timeout": timeout,
        "max_body_bytes": max_body_bytes,
    }
    # Before the store is opened (its descriptor budget is a share of the soft limit) and
    # before any worker starts (they inherit it).
    raise_descriptor_limit()
    # Built here in any case: a store, tokenizer or renderer that cannot be opened fails once,
    # with its own message, before any socket is bound or worker started.
    app = _app(settings, token, upstream_api_key)
    server_options: dict[str, Any] = {
        "host": host,
        "port": port,
        "log_level": log_level,
        "log_config": log_config(log_level),  # in each worker too
        "access_log": False,
        # Nothing here reads the client's address or scheme, so X-Forwarded-* need no
        # middleware rewriting every request's scope; nor does any client need a Server header.
        "proxy_headers": False,
        "server_header": False,
        "timeout_graceful_shutdown": 10,
    }
    if workers == 1:
        uvicorn.run(app, **server_options)
        return
    asyncio.run(app.gateway.backend.close())  # the supervisor serves nothing itself
    if not _can_enter_cwd():
        # Each worker starts by changing into this process's directory (multiprocessing's
        # spawn): one this account cannot enter (a service account started from root's home,
        # say) would fail every worker at its start. The paths above are absolute.
        os.chdir("/")
    os.environ[SETTINGS_ENV] = json.dumps(settings)
    if token is not None:
        os.environ[TOKEN_ENV] = token
    if upstream_api_key is not None:
        os.environ[UPSTREAM_KEY_ENV] = upstream_api_key
    uvicorn.run(f"{__name__}:app_from_environment", factory=True, workers=workers, **server_options)
