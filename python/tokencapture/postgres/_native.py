"""The native group commit of `PostgresStagingStore.stage` (`tokencapture._core.PostgresStageGroup`,
rust/src/staging/postgres.rs): where it connects, and when it cannot serve a store.

The connection parameters are asyncpg's own reading of the DSN and the environment (URLs and
``key=value`` strings, a host that is a unix-socket directory, ``PG*`` variables, the password
file), so both clients reach the same server as the same user. The native client speaks no
TLS and only the password methods (trust, password, md5, SCRAM): a DSN whose ``sslmode``
requires TLS, a ``target_session_attrs`` other than ``any``, or a password given as a callable
keep the asyncpg path (`native_group` returns the reason instead of a group); a TCP server
that offers TLS under ``sslmode=prefer`` (asyncpg would use it), one that refuses a session
without TLS under ``sslmode=allow`` (asyncpg would try again with TLS), or one that asks for
another authentication method is found at the first connect, and the store falls back then.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from tokencapture import _core
from tokencapture.postgres._client import ALLOWANCE_BYTES_PER_SECOND, SIZED_ABOVE_BYTES

__all__ = ["native_group"]

# SSL modes under which asyncpg may talk plain text: disable, allow, prefer (asyncpg's
# SSLMode values 0, 1, 2; prefer only to a server that does not offer TLS).
_PLAIN_MODES = {"disable", "allow", "prefer"}


def _parse(dsn: str, server_settings: dict[str, str]) -> tuple[list[Any], Any]:
    """asyncpg's addresses and parameters for `dsn` (its private parser: the exact rules of
    the client the rest of the store uses)."""
    from asyncpg import connect_utils  # type: ignore[import-untyped, unused-ignore]

    parse = connect_utils._parse_connect_dsn_and_args
    names = inspect.signature(parse).parameters
    arguments: dict[str, Any] = {name: None for name in names}
    arguments.update(dsn=dsn, server_settings=server_settings)
    addresses, params = parse(**arguments)
    return list(addresses), params


def native_group(client: Any, max_batch: int, max_leaders: int) -> _core.PostgresStageGroup | str:
    """A native group commit for `client`'s server, or why there is none (the asyncpg path
    stays)."""
    try:
        addresses, params = _parse(client.dsn, client._server_settings())
    except Exception as error:  # asyncpg's parser changed, or refuses the DSN
        return f"the DSN could not be resolved for the native client: {error!r}"
    sslmode = getattr(getattr(params, "sslmode", None), "name", "prefer").replace("_", "-")
    if sslmode not in _PLAIN_MODES:
        return f"sslmode={sslmode} needs TLS, which the native client does not speak"
    negotiation = getattr(params, "ssl_negotiation", None)
    if negotiation is not None and getattr(negotiation, "name", "postgres") != "postgres":
        return "direct TLS negotiation needs TLS, which the native client does not speak"
    attrs = getattr(params, "target_session_attrs", "any")
    if str(getattr(attrs, "value", attrs)) != "any":
        return f"target_session_attrs={attrs} is not supported by the native client"
    password = params.password
    if password is not None and not isinstance(password, str):
        return "a password given as a callable is not supported by the native client"
    places: list[tuple[str, int, bool]] = []
    for address in addresses:
        if isinstance(address, str):  # a unix socket: <dir>/.s.PGSQL.<port>
            directory, name = os.path.split(address)
            port = name.rsplit(".", 1)[-1]
            if not name.startswith(".s.PGSQL.") or not port.isdigit():
                return f"the unix socket {address!r} is not named .s.PGSQL.<port>"
            places.append((directory, int(port), True))
        else:
            host, port = address
            places.append((str(host), int(port), False))
    settings = dict(params.server_settings or {})
    application_name = settings.pop("application_name", None)
    return _core.PostgresStageGroup(
        places,
        params.user,
        password,
        params.database,
        sorted(settings.items()),
        application_name,
        client.connect_timeout,
        client.statement_timeout,
        client.allow_unflushed_commits,
        sslmode,
        client.where,
        max_batch,
        max_leaders,
        # A batch of more than 1 MiB gets the asyncpg paths' allowance (`statement_timeout_for`),
        # the same numbers: the rule lives in one place.
        SIZED_ABOVE_BYTES,
        ALLOWANCE_BYTES_PER_SECOND,
    )
