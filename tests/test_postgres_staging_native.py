"""PostgresStagingStore's native group commit (``native_group_commit=True``;
rust/src/staging/postgres.rs): the stages of threads that run no event loop go to PostgreSQL
through a Rust client whose waiters sleep without the GIL.

The behavioural tests of tests/test_postgres_staging.py run on this path too (their `staging`
and `both` fixtures); here is what is particular to it: commits shared with the connections
bounded, the DSN forms and authentication it must resolve as asyncpg does, the session check,
the fallbacks, close, a server that goes away and comes back, and a forked child.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any

import pytest
from tests.pg_server import PgServer
from tests.postgres_fixture import (  # noqa: F401
    dsn,
    execute,
    fetch,
    own_server,
    pg_dsn,
    pg_server,
    unavailable,
)
from tests.staging_backends import chain, make_record
from tests.test_fork_safety import run_forked
from tests.test_postgres_fork_safety import (
    FORKED_KEYS,
    STATEMENT_TIMEOUT,
    Calls,
    RowLocks,
    as_deployed,
    wait_for_lock_waiters,
)

from tokencapture import _core
from tokencapture.postgres import PostgresStagingStore, install_schema_sync
from tokencapture.postgres._client import Client
from tokencapture.postgres._native import native_group


def sessions(database: str) -> int:
    """Sessions of the store's application connected to `database`'s database."""
    return int(
        fetch(
            database,
            "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = 'tokencapture' "
            "AND datname = current_database()",
        )[0]["n"]
    )


def staged_count(database: str) -> int:
    return int(fetch(database, "SELECT count(*) AS n FROM tokencapture.staged_calls")[0]["n"])


def test_threads_share_commits_on_at_most_stage_flushes_native_connections(
    dsn: str,  # noqa: F811
) -> None:
    store = PostgresStagingStore(dsn, native_group_commit=True, stage_flushes=2)
    records = [chain(f"t{t}", 20, size=64) for t in range(32)]
    results: list[list[Any]] = [[] for _ in records]
    barrier = threading.Barrier(32)

    def stage(t: int) -> None:
        barrier.wait()
        results[t] = [store.stage(r) for r in records[t]]

    try:
        hops: list[object] = []
        client: Any = store._client
        threads = [threading.Thread(target=stage, args=(t,)) for t in range(32)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # After the first round trip (the schema check), no stage took the loop thread.
        for name in ("run_sync", "call_in_thread"):
            original = getattr(client, name)
            setattr(client, name, lambda *a, _o=original, **k: hops.append(a) or _o(*a, **k))
        assert all(r.ok for per in results for r in per)
        assert store.native_group_commit and store.native_fallback_reason is None
        assert store._native is not None
        calls, stages, connects = store._native.stats()
        assert stages == 640 and calls < stages // 2, (calls, stages)
        assert connects <= 2  # stage_flushes
        assert store._native.idle_connections() <= 2
        assert store.stage(make_record("after")).ok
        assert hops == []
        fetched = store.fetch([r.staging_key for per in records for r in per])
        assert [s.digest for s in fetched] == [r.digest for per in records for r in per]
        # The loop thread's one connection (fetch, the schema check) and the native ones.
        assert sessions(dsn) <= 3
    finally:
        store.close_sync()
    assert sessions(dsn) == 0  # close closed the native connections too
    refused = store.stage(make_record("closed"))
    assert not refused.ok and refused.error == "RuntimeError: the store is closed"


def test_statuses_and_refusals_word_as_the_asyncpg_path(dsn: str) -> None:  # noqa: F811
    native = PostgresStagingStore(dsn, native_group_commit=True)
    plain = PostgresStagingStore(dsn, native_group_commit=False)
    try:
        record = make_record("s", "c0", [1, 2, 3])
        assert native.stage(record).ok
        assert native.native_group_commit
        again = native.stage(record)
        assert again.ok and again.staging_key == "s/c0"
        changed = make_record("s", "c0", [1, 2, 4])
        refusals = [store.stage(changed) for store in (native, plain)]
        assert refusals[0] == refusals[1]
        assert refusals[0].error == (
            'TokenCaptureConflictError: staging key "s/c0" is already staged with different content'
        )
        native.retire(["s"])
        retired = [store.stage(make_record("s", "c1", [5])) for store in (native, plain)]
        assert retired[0] == retired[1]
        assert retired[0].error is not None and retired[0].error.startswith(
            'TokenCaptureRetiredError: rollout "s" is retired'
        )
        nul = [store.stage(make_record("r\0x")) for store in (native, plain)]
        assert nul[0] == nul[1] and nul[0].error is not None and "holds NUL" in nul[0].error
        bad = make_record("b", "c0", [1])
        tampered = bad.model_copy(update={"token_ids_delta": [2]})
        unverified = [store.stage(tampered) for store in (native, plain)]
        assert unverified[0] == unverified[1] and not unverified[0].ok
        assert native._native is not None and native._native.stats()[1] >= 4
    finally:
        native.close_sync()
        plain.close_sync()


def test_dsn_forms_reach_the_server_natively(
    pg_server: PgServer,  # noqa: F811
    pg_dsn: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The forms asyncpg reads (it refuses libpq's ``key=value`` strings, so the store does,
    whichever client stages)."""
    install_schema_sync(pg_dsn)
    database = pg_dsn.rsplit("/", 1)[1]
    forms = {
        "url": pg_dsn,
        "socket": pg_server.socket_dsn.replace("/postgres?", f"/{database}?"),
        "query": f"postgresql:///{database}?host=127.0.0.1&port={pg_server.port}&user=postgres",
        "environment": f"postgresql:///{database}",
    }
    monkeypatch.setenv("PGHOST", "127.0.0.1")
    monkeypatch.setenv("PGPORT", str(pg_server.port))
    monkeypatch.setenv("PGUSER", "postgres")
    for form, text in forms.items():
        store = PostgresStagingStore(text, native_group_commit=True)
        try:
            assert store.stage(make_record(f"dsn-{form}")).ok, form
            assert store.native_group_commit, (form, store.native_fallback_reason)
            assert store._native is not None and store._native.stats()[1] == 1, form
        finally:
            store.close_sync()
    assert staged_count(pg_dsn) == len(forms)


def test_a_password_from_the_dsn_or_the_environment(
    own_server: PgServer,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SCRAM authentication (TCP connections of role `pw` need its password)."""
    own_server.psql("CREATE ROLE pw SUPERUSER LOGIN PASSWORD 'secret w0rd'")
    hba = own_server.data / "pg_hba.conf"
    hba.write_text(
        "local all all trust\n"
        "host all pw 127.0.0.1/32 scram-sha-256\n"
        "host all all 127.0.0.1/32 trust\n"
    )
    own_server.psql("SELECT pg_reload_conf()")
    install_schema_sync(own_server.dsn)
    base = f"127.0.0.1:{own_server.port}/postgres"
    wrong = PostgresStagingStore(f"postgresql://pw:nope@{base}", native_group_commit=True)
    try:
        refused = wrong.stage(make_record("pw-wrong"))
        assert not refused.ok and refused.error is not None
        assert "password authentication failed" in refused.error
    finally:
        wrong.close_sync()
    in_dsn = PostgresStagingStore(f"postgresql://pw:secret%20w0rd@{base}", native_group_commit=True)
    monkeypatch.setenv("PGPASSWORD", "secret w0rd")
    from_env = PostgresStagingStore(f"postgresql://pw@{base}", native_group_commit=True)
    try:
        for name, store in (("dsn", in_dsn), ("env", from_env)):
            assert store.stage(make_record(f"pw-{name}")).ok
            assert store.native_group_commit
            assert store._native is not None and store._native.stats()[1] == 1
    finally:
        in_dsn.close_sync()
        from_env.close_sync()


def test_a_server_down_fails_stages_with_the_reason_and_the_next_stage_reconnects(
    own_server: PgServer,  # noqa: F811
) -> None:
    install_schema_sync(own_server.dsn)
    store = PostgresStagingStore(
        own_server.dsn, native_group_commit=True, connect_timeout=2, statement_timeout=5
    )
    try:
        assert store.stage(make_record("up", "c0", [1])).ok
        assert store.native_group_commit
        own_server.kill()
        began = time.monotonic()
        down = [store.stage(make_record("down", f"c{i}", [i])) for i in range(3)]
        assert time.monotonic() - began < 15  # bounded, never a hang
        for result in down:
            assert not result.ok and result.error is not None
            assert result.error.startswith(
                f"PostgresUnavailableError: PostgreSQL at {store._client.where} is unavailable: "
            ), result.error
        own_server.start()
        assert store.stage(make_record("up", "c1", [2])).ok
        assert store.native_group_commit
        assert store.keys() == ["up/c0", "up/c1"]
    finally:
        store.close_sync()


def test_a_session_without_flushed_commits_is_refused_natively(dsn: str) -> None:  # noqa: F811
    """The native client checks every session it opens, as the asyncpg client does."""
    client = Client(dsn, synchronous_commit=None)
    group = native_group(client, 8, 1)
    assert isinstance(group, _core.PostgresStageGroup)
    execute(dsn, "ALTER ROLE CURRENT_USER SET synchronous_commit = off")
    try:
        with pytest.raises(_core.PostgresStageError) as refused:
            group.stage(make_record("off"))
        kind, message, *_ = refused.value.args
        assert kind == "durability"
        assert message == (
            f"the session at {client.where} has synchronous_commit=off: an acknowledged record "
            "could be lost in a crash; fix the server or role setting, or pass "
            "allow_unflushed_commits=True"
        )
        # With the setting sent at connect (the default), the session is on.
        on = native_group(Client(dsn), 8, 1)
        assert not isinstance(on, str)
        assert on.stage(make_record("on")) == (0, "on/c1")
        on.close()
    finally:
        execute(dsn, "ALTER ROLE CURRENT_USER RESET synchronous_commit")
        group.close()
    assert staged_count(dsn) == 1


def test_what_the_native_client_cannot_serve_keeps_the_asyncpg_path(dsn: str) -> None:  # noqa: F811
    for query, words in (
        ("sslmode=require", "sslmode=require needs TLS"),
        # (verify-ca and verify-full need certificates asyncpg reads at once: a DSN naming
        # none is refused the same way, with asyncpg's reason.)
        ("target_session_attrs=read-write", "target_session_attrs"),
    ):
        reason = native_group(Client(f"{dsn}?{query}"), 8, 1)
        assert isinstance(reason, str) and words in reason, (query, reason)
    assert not isinstance(native_group(Client(f"{dsn}?sslmode=disable"), 8, 1), str)
    off = PostgresStagingStore(dsn, native_group_commit=False)
    by_default = PostgresStagingStore(dsn)
    try:
        assert off.stage(make_record("off")).ok
        assert not off.native_group_commit and off.native_fallback_reason == "turned off"
        assert by_default.stage(make_record("default")).ok
        assert by_default.native_group_commit and by_default.native_fallback_reason is None
    finally:
        off.close_sync()
        by_default.close_sync()


def test_a_server_offering_tls_under_sslmode_prefer_is_left_to_asyncpg() -> None:
    """asyncpg would talk TLS to it; the native client (no TLS) refuses before sending
    anything, and the store falls back (`PostgresStageError` kind 'unsupported')."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    asked: list[bytes] = []

    def answer() -> None:
        connection, _ = listener.accept()
        with connection:
            asked.append(connection.recv(8))
            connection.sendall(b"S")
            connection.recv(1)  # until the client hangs up

    server = threading.Thread(target=answer, daemon=True)
    server.start()
    group = native_group(Client(f"postgresql://postgres@127.0.0.1:{port}/db"), 8, 1)
    assert not isinstance(group, str)
    try:
        with pytest.raises(_core.PostgresStageError) as refused:
            group.stage(make_record("tls"))
        assert refused.value.args[0] == "unsupported"
        assert "offers TLS" in refused.value.args[1]
        assert asked == [bytes([0, 0, 0, 8, 0x04, 0xD2, 0x16, 0x2F])]  # an SSLRequest only
    finally:
        group.close()
        server.join(5)
        listener.close()


def _refusing_server() -> tuple[socket.socket, threading.Thread, list[bytes]]:
    """A TCP server that answers whatever a client sends first with a FATAL 28000 error (a
    `hostssl`-only `pg_hba.conf` refusing a plain session), once per connection, twice."""
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []
    fields = (
        b"SFATAL\0VFATAL\0C28000\0"
        b'Mno pg_hba.conf entry for host "127.0.0.1", user "postgres", database "db", '
        b"no encryption\0\0"
    )
    error = b"E" + struct.pack("!i", 4 + len(fields)) + fields

    def answer() -> None:
        for _ in range(2):
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            with connection:
                received.append(connection.recv(65536))
                connection.sendall(error)
                connection.recv(1)  # until the client hangs up

    server = threading.Thread(target=answer, daemon=True)
    server.start()
    return listener, server, received


def test_a_server_refusing_plain_text_under_sslmode_allow_is_left_to_asyncpg() -> None:
    """Under sslmode=allow asyncpg tries a plain session first and, refused, tries again with
    TLS: the native client (no TLS) reports the refusal as 'unsupported', so the store falls
    back to asyncpg. Under sslmode=disable the same refusal is the server's answer."""
    listener, server, received = _refusing_server()
    port = listener.getsockname()[1]
    try:
        for mode, kind in (("allow", "unsupported"), ("disable", "server")):
            group = native_group(
                Client(f"postgresql://postgres@127.0.0.1:{port}/db?sslmode={mode}"), 8, 1
            )
            assert not isinstance(group, str)
            try:
                with pytest.raises(_core.PostgresStageError) as refused:
                    group.stage(make_record(mode))
            finally:
                group.close()
            assert refused.value.args[0] == kind, (mode, refused.value.args)
            if mode == "allow":
                assert "refused a session without TLS" in refused.value.args[1]
        # A startup message each time, never an SSLRequest (8 bytes, code 80877103).
        assert len(received) == 2
        assert all(len(first) > 8 and first[4:8] == b"\x00\x03\x00\x00" for first in received)
    finally:
        listener.close()
        server.join(5)


def test_a_forked_child_stages_on_its_own_connections_beside_a_stuck_leader(
    dsn: str,  # noqa: F811
) -> None:
    """The parent's only native leader (`stage_flushes=1`) waits on the server inside its
    batch when the process forks: the child's stages lead batches of their own on sessions of
    their own (with the parent's leader count or connection they would queue forever, or
    interleave on the parent's socket), its close leaves the parent's connection open, and
    the parent's batch then completes."""
    staging = PostgresStagingStore(
        dsn,
        models="tokencapture",
        native_group_commit=True,
        stage_flushes=1,
        statement_timeout=STATEMENT_TIMEOUT,
    )
    assert staging.stage(make_record("busy", "c0", [1, 2, 3])).ok  # its fence row exists
    assert staging.stage(make_record("parent", "p0", [4, 5, 6])).ok
    assert staging._native is not None
    calls = Calls()

    def child(index: int) -> None:
        for k in range(3):
            outcome = staging.stage(make_record(f"child-{index}", f"c{k}", [index, k, 7]))
            assert outcome.ok, outcome
        assert staging.native_group_commit
        assert staging._native is not None and staging._native.stats() == (3, 3, 1)
        staging.close()

    busy = "SELECT 1 FROM tokencapture.staging_rollouts WHERE rollout_id = 'busy' FOR UPDATE"
    with RowLocks(dsn, busy):
        calls.start("stuck", staging.stage, make_record("busy", "c1", [7, 8, 9]))
        wait_for_lock_waiters(dsn, 1)
        code = run_forked(as_deployed(child), 0)
    assert code == 0, "the child hung (killed)" if code is None else f"the child failed: {code}"
    assert calls.join()["stuck"].ok
    connects = staging._native.stats()[2]
    assert staging.stage(make_record("parent", "p1", [4, 5, 6, 7])).ok
    assert staging._native.stats()[2] == connects  # the parent's connection is still open
    assert staging.keys() == FORKED_KEYS
    staging.close()
