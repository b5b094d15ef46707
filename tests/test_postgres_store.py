"""The PostgreSQL store against the file store's contract: the conformance suite, a
differential state machine (same random operations on both, every result compared), bad input
refused before any round trip, and the server's faults."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from tests.conftest import make_entry
from tests.pg_server import PgServer, PgServerUnavailable
from tests.postgres_fixture import execute, fetch, pg_dsn, pg_server, store, unavailable
from tests.test_conformance import PROCESS_CHECKS, STORE_CHECKS

from tokencapture.conformance import run_conformance
from tokencapture.postgres import (
    SCHEMA_VERSION,
    PostgresTokenCaptureStore,
    PostgresUnavailableError,
    install_schema_sync,
)
from tokencapture.protocols import (
    TokenCaptureConflictError,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
    TokenCaptureSnapshot,
)
from tokencapture.store import TokenCaptureStore, canonical_line

__all__ = ["pg_dsn", "pg_server", "store"]  # the fixtures, imported for pytest

SCHEMA_FILES = [
    "001_store.sql",
    "002_lineage.sql",
    "003_ledger.sql",
    "004_lineage_rows.sql",
    "005_staging.sql",
    "006_staging_key_order.sql",
    "007_staging_fence_insert.sql",
]

ROOT = Path(__file__).resolve().parents[1]


def lines_of(snapshot: TokenCaptureSnapshot) -> list[bytes]:
    return [canonical_line(entry) for entry in snapshot.entries]


# --- The contract, rule by rule (expected values from the file store's rules) ------------------


def test_put_freeze_round_trip_stores_the_canonical_line(store: PostgresTokenCaptureStore) -> None:
    entry = make_entry(extra_field={"kept": [1, 2]})
    store.append(entry)
    store.append(entry.model_copy())  # identical: no-op, no version bump
    snapshot = store.freeze_now("r1")
    assert snapshot.entries == (entry,)
    assert snapshot.entries[0].model_extra == {"extra_field": {"kept": [1, 2]}}
    assert len(snapshot.snapshot_id) == 32 and snapshot.version == 2
    assert store.freeze_now("r1") == snapshot  # idempotent
    stats = store.stats()
    assert stats["put"]["count"] == 2 and stats["put"]["failures"] == 0
    assert stats["freeze"]["count"] == 2


def test_conflict_marks_incomplete_durably_then_raises(store: PostgresTokenCaptureStore) -> None:
    store.append(make_entry())
    with pytest.raises(TokenCaptureConflictError, match="different payload"):
        store.append(make_entry(generation_log_probs=[-0.5, -0.3]))
    assert store.is_incomplete("r1")  # the status function kept the mark (no rollback)
    snapshot = store.freeze_now("r1")
    assert snapshot.incomplete and len(snapshot.entries) == 1 and snapshot.version == 3


def test_fences_drop_retire_delete(store: PostgresTokenCaptureStore) -> None:
    store.append(make_entry())
    store._begin_call("r1", "call-7")
    snapshot = store.freeze_now("r1")
    assert snapshot.incomplete  # the dangling intent masks it
    assert not store.is_incomplete("r1")  # but the stored flag is not set
    with pytest.raises(TokenCaptureFrozenError) as frozen:
        store.append(make_entry(call=2))
    assert not isinstance(frozen.value, TokenCaptureRetiredError)
    store._mark_incomplete("r1", "call-9")  # allowed after freeze
    assert store._drop("r1", snapshot.snapshot_id, snapshot.version) is False  # stale
    again = store.freeze_now("r1")
    assert again.version == snapshot.version + 1 and again.snapshot_id == snapshot.snapshot_id
    assert store._drop("r1", again.snapshot_id, again.version) is True
    assert store.read_entries("r1") == []
    with pytest.raises(TokenCaptureRetiredError):
        store._mark_incomplete("r1")
    assert store.retire_now(["r1", "r2"]) == {"removed": [], "absent": ["r1", "r2"]}
    assert store.delete_now(["r2", "r1", "r3"]) == {"removed": ["r2", "r1"], "absent": ["r3"]}
    store.append(make_entry())  # reuse starts empty
    assert store.freeze_now("r1").version == 2


async def test_mark_incomplete_if_open_marks_only_an_open_rollout(
    store: PostgresTokenCaptureStore,
) -> None:
    """The gateway's mark for a failed call: made on an open rollout, a no-op (False, the
    version unchanged) on a frozen or retired one, where a mark would move the snapshot's
    version and the trainer's `drop` of it would fail."""
    try:
        await store.put(make_entry())
        assert await store.mark_incomplete_if_open("r1", "lost") is True
        assert await store.is_incomplete_async("r1")
        snapshot = await store.freeze("r1")
        assert snapshot.incomplete and snapshot.version == 3  # put, mark, freeze
        assert await store.mark_incomplete_if_open("r1", "late") is False
        assert (await store.freeze("r1")).version == snapshot.version
        assert await store.drop("r1", snapshot.snapshot_id, snapshot.version)
        assert await store.mark_incomplete_if_open("r1", "later") is False  # retired
        with pytest.raises(ValueError, match="rollout_id"):
            store.mark_incomplete_if_open("bad id")
    finally:
        await store.close()  # this loop's connections


async def test_mark_incomplete_if_open_decides_under_the_rollout_lock(
    store: PostgresTokenCaptureStore, pg_dsn: str
) -> None:
    """A freeze that holds the rollout's row when the mark arrives: the mark waits for it and
    then sees the rollout frozen (a check read before the lock would see it open, and mark
    after the freeze)."""
    import asyncpg

    try:
        await store.put(make_entry())
        connection = await asyncpg.connect(pg_dsn)
        try:
            transaction = connection.transaction()
            await transaction.start()
            await connection.execute("SELECT tokencapture.lock_rollout('r1')")
            marking = asyncio.ensure_future(store.mark_incomplete_if_open("r1", "late"))
            await asyncio.sleep(0.5)
            assert not marking.done()  # waiting for the row
            await connection.fetch("SELECT * FROM tokencapture.freeze_lines('r1', 'snap')")
            await transaction.commit()
            assert await marking is False
        finally:
            await connection.close()
        snapshot = await store.freeze("r1")
        assert (snapshot.snapshot_id, snapshot.version, snapshot.incomplete) == ("snap", 2, False)
    finally:
        await store.close()  # this loop's connections


async def test_call_state_and_one_entry_are_read_without_changes(
    store: PostgresTokenCaptureStore,
) -> None:
    """For the gateway: the rollout's flags with its intents that have no entry, and one
    stored entry by its call id (None when there is none)."""
    try:
        assert await store.call_state_async("r1") is None
        await store.begin_call("r1", "call-1")
        await store.begin_call("r1", "lost")
        entry = make_entry()
        await store.put(entry)
        assert await store.call_state_async("r1") == {
            "frozen": False,
            "retired": False,
            "calls_without_entry": ["lost"],
        }
        assert await store.read_entry_async("r1", "call-1") == entry
        assert await store.read_entry_async("r1", "lost") is None
        assert await store.read_entry_async("r2", "call-1") is None
        assert (await store.freeze("r1")).version == 2  # nothing was written by the reads
        assert (await store.call_state_async("r1") or {})["frozen"] is True
    finally:
        await store.close()  # this loop's connections


async def test_async_methods_validate_when_called(store: PostgresTokenCaptureStore) -> None:
    with pytest.raises(ValueError, match="rollout_id"):
        store.freeze("bad id")  # no await needed: refused at the call
    with pytest.raises(TypeError):
        store.retire("r1")
    with pytest.raises(ValueError, match="line break"):
        store.begin_call("r1", "a\nb")
    await store.put(make_entry())
    assert (await store.freeze("r1")).version == 2
    await store.close()
    await store.close()  # idempotent


def test_store_conformance(pg_dsn: str) -> None:
    install_schema_sync(pg_dsn)

    async def run() -> list[str]:
        return await run_conformance(
            lambda: PostgresTokenCaptureStore(pg_dsn),
            lambda: PostgresTokenCaptureStore(pg_dsn),
            process_factory=functools.partial(PostgresTokenCaptureStore, pg_dsn),
        )

    assert asyncio.run(run()) == STORE_CHECKS + PROCESS_CHECKS


def test_schema_is_required_unless_installed(pg_dsn: str) -> None:
    fresh = PostgresTokenCaptureStore(pg_dsn)
    with pytest.raises(RuntimeError, match="tokencapture db init"):
        fresh.is_incomplete("r1")
    fresh.close_sync()
    assert install_schema_sync(pg_dsn) == SCHEMA_FILES
    assert install_schema_sync(pg_dsn) == []  # upgrade is a no-op when current


def test_unflushed_commits_are_refused_unless_allowed(pg_dsn: str) -> None:
    install_schema_sync(pg_dsn)
    with pytest.raises(RuntimeError, match="allow_unflushed_commits"):
        PostgresTokenCaptureStore(pg_dsn, synchronous_commit="off")
    # A session that reports it off (a role or database setting) is refused at connect.
    no_setting = PostgresTokenCaptureStore(pg_dsn, synchronous_commit=None)
    no_setting.is_incomplete("r1")
    no_setting.close_sync()
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import asyncio, asyncpg, sys\n"
            "async def main():\n"
            "    c = await asyncpg.connect(sys.argv[1])\n"
            "    await c.execute('ALTER ROLE postgres IN DATABASE ' + c._params.database"
            " + ' SET synchronous_commit = off')\n"
            "    await c.close()\n"
            "asyncio.run(main())\n",
            pg_dsn,
        ],
        check=True,
    )
    refused = PostgresTokenCaptureStore(pg_dsn, synchronous_commit=None)
    with pytest.raises(RuntimeError, match="synchronous_commit=off"):
        refused.is_incomplete("r1")
    refused.close_sync()
    allowed = PostgresTokenCaptureStore(
        pg_dsn, synchronous_commit=None, allow_unflushed_commits=True
    )
    assert allowed.is_incomplete("r1") is False
    allowed.close_sync()
    forced_on = PostgresTokenCaptureStore(pg_dsn)  # sends synchronous_commit=on at connect
    assert forced_on.is_incomplete("r1") is False
    forced_on.close_sync()


def test_missing_driver_is_an_import_error_naming_the_extra() -> None:
    code = (
        "import sys; sys.modules['asyncpg'] = None\n"
        "import tokencapture\n"
        "try:\n"
        "    tokencapture.PostgresTokenCaptureStore\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert "pip install tokencapture[postgres]" in result.stdout


def test_import_tokencapture_does_not_import_the_driver() -> None:
    code = "import sys, tokencapture; print('asyncpg' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


# --- Bad input: the file store's errors, before any round trip --------------------------------

# Nothing listens on this port: any round trip would be a PostgresUnavailableError instead.
_NOWHERE = "postgresql://postgres@127.0.0.1:9/postgres"


def _outcome(call: Callable[[], object]) -> tuple[str, str]:
    """What a call gives: its exception (type and message) or its result; a coroutine it
    returns is run (a refusal must come from the call itself, before any await)."""
    try:
        result = call()
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", repr(result)


_BAD_CALLS: list[tuple[str, Callable[[Any], object]]] = [
    ("empty rollout", lambda s: s.freeze("")),
    ("slash rollout", lambda s: s.freeze("a/b")),
    ("long rollout", lambda s: s.drop("x" * 300, "s", 1)),
    ("int rollout", lambda s: s.freeze(5)),
    ("surrogate rollout", lambda s: s.mark_incomplete("r\ud800")),
    ("bare string batch", lambda s: s.retire("r1")),
    ("bad id in batch", lambda s: s.delete(["ok", "no way"])),
    ("empty call id", lambda s: s.begin_call("r1", "")),
    ("newline call id", lambda s: s.begin_call("r1", "a\nb")),
    ("spaced call id", lambda s: s.begin_call("r1", " a")),
    ("int call id", lambda s: s.begin_call("r1", 7)),
    ("tab-ended call id", lambda s: s.put(make_entry(call="a\t"))),
    ("surrogate call id", lambda s: s.begin_call("r1", "\udc80")),
    ("nan entry", lambda s: s.put(make_entry(generation_log_probs=[float("nan"), 0.0]))),
    ("huge int", lambda s: s.put(make_entry(prompt_token_ids=[2**64]))),
    ("not an entry", lambda s: s.put(42)),
    ("dict missing fields", lambda s: s.put({"rollout_id": "r1"})),
    ("bad rollout in entry", lambda s: s.put(make_entry(rollout_id="a b"))),
    ("int snapshot id", lambda s: s.drop("r1", 5, 1)),
    ("negative drop version", lambda s: s.drop("r1", "x", -1)),
    ("bool drop version", lambda s: s.drop("r1", "x", True)),
    ("sync drop bad id bad version", lambda s: s._drop("bad id", "x", -1)),
    ("empty batches", lambda s: (asyncio.run(s.retire([])), asyncio.run(s.delete(())))),
]
_NO_ROUND_TRIP = ("empty batches", "negative", "bool", "sync drop")


@pytest.mark.parametrize(("name", "call"), _BAD_CALLS, ids=[name for name, _ in _BAD_CALLS])
def test_bad_input_is_refused_like_the_file_store_before_any_round_trip(
    tmp_path: Path, name: str, call: Callable[[Any], object]
) -> None:
    files = TokenCaptureStore(tmp_path / "files")
    pg = PostgresTokenCaptureStore(_NOWHERE, connect_timeout=2)
    try:
        expected = _outcome(lambda: call(files))
        assert expected[0] != "ok" or name.startswith(_NO_ROUND_TRIP)
        assert _outcome(lambda: call(pg)) == expected
    finally:
        pg.close_sync()


_SYNC_BAD_CALLS: list[Callable[[Any], object]] = [
    lambda s: s.freeze_now("a/b"),
    lambda s: s.read_entries(5),
    lambda s: s.is_incomplete(""),
    lambda s: s._begin_call("r1", "a\nb"),
    lambda s: s._mark_incomplete("bad id"),
    lambda s: s.append(make_entry(call=" x")),
    lambda s: s.retire_now("r1"),
    lambda s: s.delete_now([1]),
]


@pytest.mark.parametrize("call", _SYNC_BAD_CALLS)
def test_sync_twins_refuse_bad_input_with_the_same_exception_types(
    tmp_path: Path, call: Callable[[Any], object]
) -> None:
    files = TokenCaptureStore(tmp_path / "files")
    pg = PostgresTokenCaptureStore(_NOWHERE, connect_timeout=2)
    try:
        expected = _outcome(lambda: call(files))
        assert expected[0] in ("ValueError", "TypeError")
        assert _outcome(lambda: call(pg))[0] == expected[0]
    finally:
        pg.close_sync()


# --- The differential state machine ------------------------------------------------------------

_CALL_IDS = ["call-1", "call-2", "c\x00nul", "é-ü", "call-3"]
_ODD_MARKERS = ["", "call-1", "a\nb", "\ud800x", "call-2"]


class _Shared:
    """One PostgreSQL store for every example (each example uses fresh rollout ids)."""

    store: PostgresTokenCaptureStore | None = None
    loop: asyncio.AbstractEventLoop | None = None  # every example's awaits run on it


class StoresAgree(RuleBasedStateMachine):
    """The same random operations on the file store and the PostgreSQL store: every result,
    exception type and message, and snapshot agree (snapshot ids by their equality pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.tag = uuid.uuid4().hex[:8]
        self.dir = Path(f"/tmp/tokencapture-sm-{self.tag}")
        self.files = TokenCaptureStore(self.dir)
        assert _Shared.store is not None
        self.pg = _Shared.store
        self.ids: dict[str, str] = {}  # file snapshot id -> PostgreSQL snapshot id
        self.snapshots: dict[str, tuple[str, int]] = {}  # rollout -> last file snapshot

    def teardown(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)

    def rollout(self, n: int) -> str:
        return f"{self.tag}-r{n}"

    def both(self, call: Callable[[Any], object]) -> tuple[object, object]:
        """The protocol's API on both stores (a returned coroutine is awaited)."""
        assert _Shared.loop is not None
        outcomes = []
        for backend in (self.files, self.pg):
            try:
                result = call(backend)
                if asyncio.iscoroutine(result):
                    result = _Shared.loop.run_until_complete(result)
                outcomes.append(("ok", result))
            except Exception as exc:
                outcomes.append((type(exc).__name__, str(exc)))
        file_outcome, pg_outcome = outcomes
        assert file_outcome[0] == pg_outcome[0], (file_outcome, pg_outcome)
        if file_outcome[0] != "ok":
            assert file_outcome[1] == pg_outcome[1]
        return file_outcome[1], pg_outcome[1]

    def same_snapshot(self, file_snap: TokenCaptureSnapshot, pg_snap: TokenCaptureSnapshot) -> None:
        assert lines_of(file_snap) == lines_of(pg_snap)
        assert file_snap.entries == pg_snap.entries
        assert (file_snap.incomplete, file_snap.version) == (pg_snap.incomplete, pg_snap.version)
        known = self.ids.setdefault(file_snap.snapshot_id, pg_snap.snapshot_id)
        assert known == pg_snap.snapshot_id
        assert list(self.ids.values()).count(pg_snap.snapshot_id) == 1  # a bijection

    @initialize()
    def start(self) -> None:
        pass

    @rule(r=st.integers(0, 2), call=st.sampled_from(_CALL_IDS), variant=st.integers(0, 1))
    def put(self, r: int, call: str, variant: int) -> None:
        entry = make_entry(self.rollout(r), call=call, generation_log_probs=[-0.5, -0.25 - variant])
        self.both(lambda s: s.put(entry))

    @rule(r=st.integers(0, 2), call=st.sampled_from([*_CALL_IDS, "call-9", " x"]))
    def begin_call(self, r: int, call: str) -> None:
        self.both(lambda s: s.begin_call(self.rollout(r), call))

    @rule(r=st.integers(0, 2), marker=st.sampled_from(_ODD_MARKERS))
    def mark_incomplete(self, r: int, marker: str) -> None:
        self.both(lambda s: s.mark_incomplete(self.rollout(r), marker))

    @rule(r=st.integers(0, 2))
    def freeze(self, r: int) -> None:
        file_snap, pg_snap = self.both(lambda s: s.freeze(self.rollout(r)))
        if isinstance(file_snap, TokenCaptureSnapshot):
            assert isinstance(pg_snap, TokenCaptureSnapshot)
            self.same_snapshot(file_snap, pg_snap)
            self.snapshots[self.rollout(r)] = (file_snap.snapshot_id, file_snap.version)

    @rule(r=st.integers(0, 2), stale=st.integers(-1, 1), other_id=st.booleans())
    def drop(self, r: int, stale: int, other_id: bool) -> None:
        rollout = self.rollout(r)
        file_id, version = self.snapshots.get(rollout, ("0" * 32, 1))
        pg_id = self.ids.get(file_id, file_id)
        if other_id:
            file_id = pg_id = "f" * 32
        assert _Shared.loop is not None
        outcomes = []
        for backend, snapshot_id in ((self.files, file_id), (self.pg, pg_id)):
            drop = backend.drop(rollout, snapshot_id, version + stale)
            outcomes.append(_Shared.loop.run_until_complete(drop))
        assert outcomes[0] == outcomes[1]

    @rule(rs=st.lists(st.integers(0, 3), max_size=3))
    def retire(self, rs: list[int]) -> None:
        file_result, pg_result = self.both(lambda s: s.retire([self.rollout(r) for r in rs]))
        assert file_result == pg_result

    @rule(rs=st.lists(st.integers(0, 3), max_size=3))
    def delete(self, rs: list[int]) -> None:
        file_result, pg_result = self.both(lambda s: s.delete([self.rollout(r) for r in rs]))
        assert file_result == pg_result

    @rule(r=st.integers(0, 3))
    def read(self, r: int) -> None:
        file_result, pg_result = self.both(lambda s: s.read_entries(self.rollout(r)))
        assert file_result == pg_result

    @invariant()
    def flags_agree(self) -> None:
        for r in range(3):
            file_flag, pg_flag = self.both(lambda s, r=r: s.is_incomplete(self.rollout(r)))
            assert file_flag == pg_flag


def test_file_and_postgres_stores_agree(pg_dsn: str) -> None:
    install_schema_sync(pg_dsn)
    _Shared.store = PostgresTokenCaptureStore(pg_dsn)
    _Shared.loop = asyncio.new_event_loop()
    try:
        StoresAgree.TestCase.settings = settings(
            max_examples=int(os.environ.get("TOKENCAPTURE_SM_EXAMPLES", "60")),
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        StoresAgree.TestCase().runTest()
    finally:
        _Shared.loop.run_until_complete(_Shared.store.close())
        _Shared.loop.close()
        _Shared.store = _Shared.loop = None


# --- Faults ------------------------------------------------------------------------------------


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[PgServer]:
    """A server of this test's own (the fault tests kill and restart it)."""
    try:
        server = PgServer()
    except (PgServerUnavailable, OSError) as exc:
        unavailable(str(exc))
        raise
    try:
        server.start()
        install_schema_sync(server.dsn)
        yield server
    finally:
        server.cleanup()


def test_server_down_at_start_and_while_running_is_an_oserror_in_time(
    own_server: PgServer,
) -> None:
    own_server.stop()
    store = PostgresTokenCaptureStore(own_server.dsn, connect_timeout=2, statement_timeout=5)
    try:
        started = time.monotonic()
        with pytest.raises(OSError) as down:
            store.append(make_entry())
        assert isinstance(down.value, PostgresUnavailableError)
        assert time.monotonic() - started < 5
        own_server.start()
        store.append(make_entry())  # works once it is back
        own_server.kill()
        started = time.monotonic()
        with pytest.raises(OSError):
            store.append(make_entry(call=2))
        with pytest.raises(OSError):
            store.freeze_now("r1")
        assert time.monotonic() - started < 10
        own_server.start()
        store.append(make_entry(call=2))
        assert [e.model_call_id for e in store.freeze_now("r1").entries] == ["call-1", "call-2"]
    finally:
        store.close_sync()


_WORKER = """
import json, os, sys, time
sys.path.insert(0, {root!r})
from tests.conftest import make_entry
from tokencapture.postgres import PostgresTokenCaptureStore
from tokencapture.protocols import TokenCaptureRetiredError
dsn, log, mode = sys.argv[1], sys.argv[4], sys.argv[5]
index, count = int(sys.argv[2]), int(sys.argv[3])
store = PostgresTokenCaptureStore(dsn, connect_timeout=2, statement_timeout=5)
with open(log, "a") as out:
    def note(**fields):
        out.write(json.dumps(fields) + "\\n"); out.flush(); os.fsync(out.fileno())
    for n in range(count):
        rollout = "race" if mode == "race" else f"w{{index}}-r{{n % 3}}"
        tokens = list(range(n, n + 40))
        entry = make_entry(rollout, call=f"w{{index}}-c{{n}}", prompt_token_ids=tokens)
        while True:
            note(event="try", rollout=rollout, call=entry.model_call_id)
            try:
                store.append(entry)
            except TokenCaptureRetiredError:
                note(event="retired", rollout=rollout, call=entry.model_call_id, at=time.time())
                break
            except OSError as exc:
                note(event="error", rollout=rollout, call=entry.model_call_id, error=str(exc))
                time.sleep(0.05)
                continue  # a retried put is idempotent
            note(event="ack", rollout=rollout, call=entry.model_call_id, at=time.time())
            break
        if mode == "puts" and n % 10 == 9:
            # A mark is not idempotent: not retried; attempts and acks are both logged.
            note(event="mark-try", rollout=rollout)
            try:
                store._mark_incomplete(rollout, f"lost-{{n}}")
                note(event="mark-ack", rollout=rollout)
            except OSError:
                note(event="mark-error", rollout=rollout)
    if mode == "puts":
        fence = f"w{{index}}-fence"
        while True:  # a fence: retried until acknowledged (retire is idempotent)
            try:
                store.append(make_entry(fence, call="only"))
                store.retire_now([fence])
                note(event="fence-ack", rollout=fence)
                break
            except TokenCaptureRetiredError:
                note(event="fence-ack", rollout=fence)  # an earlier attempt committed
                break
            except OSError:
                time.sleep(0.05)
    if mode == "race":
        # Keep trying until the fence is seen.
        n = count
        while True:
            entry = make_entry("race", call=f"w{{index}}-late{{n}}")
            try:
                store.append(entry)
                note(event="ack", rollout="race", call=entry.model_call_id, at=time.time())
            except TokenCaptureRetiredError:
                note(event="retired", rollout="race", call=entry.model_call_id, at=time.time())
                break
            n += 1
store.close_sync()
"""


def _events(log: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]


def _start_workers(
    tmp_path: Path, dsn: str, workers: int, count: int, mode: str
) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER.format(root=str(ROOT)))
    logs = [tmp_path / f"worker-{i}.log" for i in range(workers)]
    procs = [
        subprocess.Popen([sys.executable, str(script), dsn, str(i), str(count), str(log), mode])
        for i, log in enumerate(logs)
    ]
    return procs, logs


def test_sigkill_of_the_server_loses_no_acknowledged_put(
    own_server: PgServer, tmp_path: Path
) -> None:
    procs, logs = _start_workers(tmp_path, own_server.dsn, workers=3, count=150, mode="puts")
    try:
        for _ in range(2):  # two SIGKILLs at points where puts are in flight
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                acks = sum(
                    1 for log in logs if log.exists() for e in _events(log) if e["event"] == "ack"
                )
                if acks >= 60:
                    break
                time.sleep(0.05)
            own_server.kill()
            time.sleep(0.3)
            own_server.start()
            time.sleep(0.3)
        for proc in procs:
            assert proc.wait(timeout=120) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    events = [event for log in logs for event in _events(log)]
    assert any(event["event"] == "error" for event in events), "no put was in flight at a kill"
    acked = {(e["rollout"], e["call"]) for e in events if e["event"] == "ack"}
    assert len(acked) == 3 * 150  # every put was eventually acknowledged (retries included)
    store = PostgresTokenCaptureStore(own_server.dsn)
    try:
        fences = {e["rollout"] for e in events if e["event"] == "fence-ack"}
        assert len(fences) == 3
        for fence in fences:  # every acknowledged fence holds
            with pytest.raises(TokenCaptureRetiredError):
                store.append(make_entry(fence, call="late"))
            assert store.read_entries(fence) == []
        for rollout in {rollout for rollout, _ in acked}:
            snapshot = store.freeze_now(rollout)
            stored = [entry.model_call_id for entry in snapshot.entries]
            assert sorted(stored) == sorted(call for r, call in acked if r == rollout)
            # One version per entry, one per mark that landed, one for the freeze: a retried
            # put after an error landed once; every acknowledged mark is there.
            marks = snapshot.version - len(stored) - 1
            tried = sum(1 for e in events if e["event"] == "mark-try" and e["rollout"] == rollout)
            done = sum(1 for e in events if e["event"] == "mark-ack" and e["rollout"] == rollout)
            assert done <= marks <= tried
            assert snapshot.incomplete == (marks > 0)
            for entry in snapshot.entries:
                n = int(entry.model_call_id.split("-c")[1])
                assert entry.prompt_token_ids == list(range(n, n + 40))  # whole, not torn
    finally:
        store.close_sync()


def test_processes_racing_retire_land_no_put_after_it_returns(
    own_server: PgServer, tmp_path: Path
) -> None:
    procs, logs = _start_workers(tmp_path, own_server.dsn, workers=3, count=30, mode="race")
    store = PostgresTokenCaptureStore(own_server.dsn)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            acks = sum(
                1 for log in logs if log.exists() for e in _events(log) if e["event"] == "ack"
            )
            if acks >= 45:
                break
            time.sleep(0.02)
        result = store.retire_now(["race"])
        # After retire returns, nothing lands: the rollout holds no entries now and, since
        # nothing removes entries of a fenced rollout, none landed later either.
        assert store.read_entries("race") == []
        assert result == {"removed": ["race"], "absent": []}
        for proc in procs:
            assert proc.wait(timeout=60) == 0
        assert all(any(e["event"] == "retired" for e in _events(log)) for log in logs)
        assert store.read_entries("race") == []
        with pytest.raises(TokenCaptureRetiredError):
            store.freeze_now("race")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        store.close_sync()


class CuttingProxy:
    """A TCP proxy to the server that can cut every open connection mid-operation."""

    def __init__(self, target_port: int) -> None:
        import socket
        import threading

        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: set[Any] = set()
        self.lock = threading.Lock()
        self.cuts = 0
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.sockets.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: Any, sink: Any) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            self._close(source)
            self._close(sink)

    def _close(self, sock: Any) -> None:
        import socket

        with self.lock:
            self.sockets.discard(sock)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()

    def cut(self) -> None:
        """Close every proxied connection now, whatever is in flight."""
        with self.lock:
            open_sockets = list(self.sockets)
        for sock in open_sockets:
            self._close(sock)
        self.cuts += 1

    def close(self) -> None:
        self.listener.close()
        self.cut()


def test_connections_cut_mid_operation_lose_or_tear_nothing(own_server: PgServer) -> None:
    import threading

    proxy = CuttingProxy(own_server.port)
    dsn = f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres"
    store = PostgresTokenCaptureStore(dsn, connect_timeout=2, statement_timeout=5, pool_size=8)
    stop = threading.Event()

    def cutter() -> None:
        while not stop.wait(0.05):
            proxy.cut()

    acked: list[tuple[str, str]] = []
    errors = 0
    marks_acked = 0
    marks_tried = 0

    async def writer(index: int) -> None:
        nonlocal errors, marks_acked, marks_tried
        # At least 20 puts each, and on until operations have been cut (an idle machine can
        # finish 20 between two cuts); bounded at 400.
        for n in range(400):
            if n >= 20 and proxy.cuts > 5 and errors > 0:
                break
            entry = make_entry(f"cut-{index % 4}", call=f"w{index}-c{n}", prompt_token_ids=[n] * 50)
            while True:
                try:
                    await store.put(entry)
                    break
                except OSError:
                    errors += 1  # unacknowledged: retried (a put is idempotent)
            acked.append((entry.rollout_id, entry.model_call_id))
            if n % 10 == 0:
                marks_tried += 1
                try:
                    await store.mark_incomplete(entry.rollout_id, f"mark-{index}-{n}")
                    marks_acked += 1
                except OSError:
                    errors += 1  # not retried: it may or may not have landed

    async def run() -> None:
        await asyncio.gather(*(writer(i) for i in range(6)))
        await store.close()

    thread = threading.Thread(target=cutter, daemon=True)
    thread.start()
    try:
        asyncio.run(run())
    finally:
        stop.set()
        thread.join()
        proxy.close()
    assert proxy.cuts > 5 and errors > 0, "no operation was cut"
    direct = PostgresTokenCaptureStore(own_server.dsn)
    try:
        total_marks = 0
        for r in range(4):
            rollout = f"cut-{r}"
            snapshot = direct.freeze_now(rollout)
            stored = [entry.model_call_id for entry in snapshot.entries]
            assert sorted(stored) == sorted(call for rid, call in acked if rid == rollout)
            for entry in snapshot.entries:  # whole, never torn
                n = int(entry.model_call_id.split("-c")[1])
                assert entry.prompt_token_ids == [n] * 50
            # Versions: one per entry, one per mark that landed, one for the freeze.
            total_marks += snapshot.version - len(stored) - 1
        assert marks_acked <= total_marks <= marks_tried
    finally:
        direct.close_sync()


@pytest.mark.parametrize(
    "stored",
    [b'{"model_call_id":"call-1","rollout_id":"r1"}', b"not json", b'{"model_call_id":"call-1",'],
)
def test_a_damaged_line_with_a_matching_digest_is_corruption_not_an_entry(
    store: PostgresTokenCaptureStore, pg_dsn: str, stored: bytes
) -> None:
    from tokencapture import _core
    from tokencapture.protocols import TokenCaptureCorruptionError

    store.append(make_entry())
    execute(
        pg_dsn,
        "UPDATE tokencapture.entries SET line = $1, digest = $2",
        stored,
        _core.payload_digest(stored),
    )
    with pytest.raises(TokenCaptureCorruptionError, match="in PostgreSQL"):
        store.read_entries("r1")
    with pytest.raises(TokenCaptureCorruptionError, match="in PostgreSQL"):
        store.freeze_now("r1")


def test_a_stored_line_holding_a_newline_is_corruption(
    store: PostgresTokenCaptureStore, pg_dsn: str
) -> None:
    """Still valid JSON (the newline is whitespace) and matching its digest, but joined into a
    log it would be two lines: every read of the fetched rows refuses it, naming where."""
    from tokencapture import _core
    from tokencapture.protocols import TokenCaptureCorruptionError
    from tokencapture.store import canonical_line

    store.append(make_entry())
    line = canonical_line(make_entry())
    column = line.index(b",") + 1
    stored = line[:column] + b"\n" + line[column:]
    execute(
        pg_dsn,
        "UPDATE tokencapture.entries SET line = $1, digest = $2",
        stored,
        _core.payload_digest(stored),
    )
    message = (
        rf"^rollout 'r1' in PostgreSQL at .*: the line holds a newline at column {column}: "
        r"a stored line must be one line \(byte offset 0\)$"
    )
    for read in (
        store.read_entries,
        store.read_columns,
        store.freeze_now,
        store.freeze_columns_now,
    ):
        with pytest.raises(TokenCaptureCorruptionError, match=message):
            read("r1")


async def test_puts_sharing_a_batch_keep_their_own_outcomes(
    store: PostgresTokenCaptureStore, tmp_path: Path
) -> None:
    files = TokenCaptureStore(tmp_path / "files")
    first = [make_entry(f"b{r}", call=1) for r in range(3)]
    for backend in (files, store):
        for entry in first:
            await backend.put(entry)
    # One gather: new calls, an identical retry (a no-op) and a conflicting payload (refused,
    # the rollout marked incomplete) of three rollouts: one batch on the PostgreSQL side.
    wave = [
        *(make_entry(f"b{r}", call=c) for r in range(3) for c in (2, 3)),
        make_entry("b0", call=1),
        make_entry("b1", call=1, generation_log_probs=[-9.0, -9.0]),
    ]
    outcomes = []
    for backend in (files, store):
        results = await asyncio.gather(*(backend.put(e) for e in wave), return_exceptions=True)
        outcomes.append([type(result).__name__ for result in results])
    assert outcomes[0] == outcomes[1]
    assert outcomes[1].count("TokenCaptureConflictError") == 1
    for r in range(3):
        expected, got = files.freeze_now(f"b{r}"), await store.freeze(f"b{r}")
        assert lines_of(expected) == sorted(lines_of(got), key=lines_of(expected).index)
        assert (expected.incomplete, expected.version) == (got.incomplete, got.version)
    await store.close()  # on the loop whose pool it closes


async def test_put_unless_stored_keeps_the_stored_entry_as_the_file_store_does(
    store: PostgresTokenCaptureStore, pg_dsn: str, tmp_path: Path
) -> None:
    """Another entry under the call id stands and nothing is written or marked (the
    conflict's mark rolled back with its transaction), the same entry is a no-op, a new one
    is stored: as the file store's; and of two attempts at once through two stores on the
    database, exactly one is stored."""
    files = TokenCaptureStore(tmp_path / "files")
    first, other = make_entry(), make_entry(generation_log_probs=[-9.0, -9.0])
    outcomes = []
    for backend in (files, store):
        outcomes.append(
            [
                await backend.put_unless_stored(first),
                await backend.put_unless_stored(other),
                await backend.put_unless_stored(first),
                await backend.put_unless_stored(make_entry(call=2)),
            ]
        )
    assert outcomes[0] == outcomes[1] == [False, True, False, False]
    expected, got = files.freeze_now("r1"), await store.freeze("r1")
    assert lines_of(got) == lines_of(expected)
    assert (got.incomplete, got.version) == (expected.incomplete, expected.version) == (False, 3)
    with pytest.raises(TokenCaptureFrozenError):
        await store.put_unless_stored(make_entry(call=3))
    second = PostgresTokenCaptureStore(pg_dsn)
    try:
        for n in range(20):
            rollout = f"race{n}"
            results = await asyncio.gather(
                store.put_unless_stored(make_entry(rollout, generation_log_probs=[-1.0, -1.0])),
                second.put_unless_stored(make_entry(rollout, generation_log_probs=[-2.0, -2.0])),
            )
            assert sorted(results) == [False, True], (rollout, results)
            snapshot = await store.freeze(rollout)
            assert len(snapshot.entries) == 1 and not snapshot.incomplete
    finally:
        await second.close()
    await store.close()


def test_an_older_schema_is_refused_then_upgraded_on_first_use(pg_dsn: str) -> None:
    import asyncpg

    from tokencapture.postgres._schema import migrations

    async def install_first(count: int) -> None:
        connection = await asyncpg.connect(pg_dsn)
        await connection.execute(
            "CREATE SCHEMA tokencapture; CREATE TABLE tokencapture.schema_migrations ("
            "version integer PRIMARY KEY, name text NOT NULL, "
            "applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for version, name, sql in migrations()[:count]:
            await connection.execute(sql)
            await connection.execute(
                "INSERT INTO tokencapture.schema_migrations (version, name) VALUES ($1, $2)",
                version,
                name,
            )
        await connection.close()

    asyncio.run(install_first(3))
    old = PostgresTokenCaptureStore(pg_dsn)
    with pytest.raises(RuntimeError, match=f"schema version 3, this client needs {SCHEMA_VERSION}"):
        old.append(make_entry())
    old.close_sync()
    upgrading = PostgresTokenCaptureStore(pg_dsn, install_schema=True)
    upgrading.append(make_entry())  # the newer files applied first
    assert upgrading.freeze_now("r1").version == 2
    upgrading.close_sync()
    assert install_schema_sync(pg_dsn) == []


async def test_a_freeze_waits_for_a_put_in_flight_and_returns_its_entry(
    store: PostgresTokenCaptureStore, pg_dsn: str
) -> None:
    """A put holding the rollout's lock (committed while the freeze waits for it) is in the
    snapshot: the freeze reads the lines in a statement that starts after it got the lock."""
    import asyncpg

    first, in_flight = make_entry(model_call_id="c1"), make_entry(model_call_id="c2")
    await store.put(first)
    connection = await asyncpg.connect(pg_dsn)
    try:
        transaction = connection.transaction()
        await transaction.start()
        status = await connection.fetchval(
            "SELECT tokencapture.put($1, $2, $3, $4)", *store._put_args(in_flight)
        )
        assert status == 0
        freezing = asyncio.ensure_future(store.freeze("r1"))
        await asyncio.sleep(0.3)
        assert not freezing.done()  # waiting for the put's lock
        await transaction.commit()
        snapshot = await asyncio.wait_for(freezing, 10)
    finally:
        await connection.close()
    assert snapshot.entries == (first, in_flight)
    assert snapshot.version == 3  # two puts, then the freeze
    with pytest.raises(TokenCaptureFrozenError):
        await store.put(make_entry(model_call_id="c3"))
    await store.close()  # on the loop whose pool it closes


def test_the_functions_of_earlier_versions_still_answer_after_the_upgrade(
    store: PostgresTokenCaptureStore, pg_dsn: str
) -> None:
    """A client of schema version 3 (lineage_tail) during a rolling upgrade still gets its
    answers; freeze_lines freezes as this client's freeze does."""
    entries = [make_entry(model_call_id=f"c{i}", prompt_token_ids=[i] * 5) for i in range(3)]
    for entry in entries:
        store.append(entry)
    rows = fetch(pg_dsn, "SELECT * FROM tokencapture.freeze_lines($1, $2)", "r1", "s-old")
    assert [row["line"] for row in rows[1:]] == [canonical_line(e) for e in entries]
    outcome = rows[0]
    snapshot = store.freeze_now("r1")  # frozen by freeze_lines: the same snapshot
    assert (outcome["status"], outcome["snapshot_id"], outcome["version"]) == (0, "s-old", 4)
    assert (snapshot.snapshot_id, snapshot.version, snapshot.entries) == (
        "s-old",
        4,
        tuple(entries),
    )
    tail = fetch(pg_dsn, "SELECT * FROM tokencapture.lineage_tail($1, 0, 0)", "r1")[0]
    assert tail["lines"] == [canonical_line(e) for e in entries] and not tail["retired"]
    store.retire_now(["r1"])
    rows = fetch(pg_dsn, "SELECT * FROM tokencapture.freeze_lines($1, $2)", "r1", "s-new")
    assert [row["status"] for row in rows] == [4]


async def test_concurrent_first_use_of_many_stores_installs_once(pg_dsn: str) -> None:
    stores = [PostgresTokenCaptureStore(pg_dsn, install_schema=True) for _ in range(4)]
    await asyncio.gather(*(s.put(make_entry(call=i)) for i, s in enumerate(stores)))
    snapshot = await stores[0].freeze("r1")
    assert len(snapshot.entries) == 4 and snapshot.version == 5
    for s in stores:
        await s.close()


async def test_the_pool_is_bounded_and_waits_for_a_connection_within_the_timeout(
    pg_dsn: str,
) -> None:
    from tokencapture.postgres._client import Client

    client = Client(pg_dsn, pool_size=3, connect_timeout=5, install_schema=True)
    observer = Client(pg_dsn, pool_size=1, install_schema=True)
    sleeping = (
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'tokencapture'"
        " AND state = 'active' AND query = 'SELECT pg_sleep(0.3)'"
    )
    begin = time.monotonic()
    burst = asyncio.gather(*(client.fetch("val", "SELECT pg_sleep(0.3)") for _ in range(7)))
    seen = []
    while not burst.done():
        seen.append(await observer.fetch("val", sleeping))
        await asyncio.sleep(0.02)
    await burst
    assert max(seen) == 3  # never more connections than the pool's size
    assert time.monotonic() - begin >= 0.85  # seven sleeps over three connections
    await client.close()
    # While every connection is busy, another caller waits for one, then gives up in time
    # (without the timeout it would get a connection when the sleeps end, ~3 s later).
    small = Client(pg_dsn, pool_size=2, connect_timeout=0.5)
    busy = asyncio.gather(*(small.fetch("val", "SELECT pg_sleep(3)") for _ in range(2)))
    await asyncio.sleep(0.2)
    started = time.monotonic()
    with pytest.raises(PostgresUnavailableError, match="TimeoutError"):
        await small.fetch("val", "SELECT 1")
    assert 0.4 <= time.monotonic() - started < 2.5
    await busy
    assert await small.fetch("val", "SELECT 1") == 1
    await small.close()
    await observer.close()


async def test_a_pooled_connection_the_server_closed_is_replaced(pg_dsn: str) -> None:
    from tokencapture.postgres._client import Client

    client = Client(pg_dsn, pool_size=2, install_schema=True)
    first = await client.fetch("val", "SELECT pg_backend_pid()")
    killer = Client(pg_dsn, pool_size=1)
    assert await killer.fetch("val", "SELECT pg_terminate_backend($1)", first)
    await killer.close()
    await asyncio.sleep(0.1)
    second = await client.fetch("val", "SELECT pg_backend_pid()")
    assert second != first
    assert await client.fetch("val", "SELECT pg_backend_pid()") == second  # reused
    # One idle past the pool's limit (asyncpg's 300 s by default) is closed, not reused.
    (await client.pool())._max_idle = 0.2
    await asyncio.sleep(0.3)
    third = await client.fetch("val", "SELECT pg_backend_pid()")
    assert third not in (first, second)
    (await client.pool())._max_idle = 300.0
    assert await client.fetch("val", "SELECT pg_backend_pid()") == third
    await client.close()


async def test_a_coordinator_reporting_its_postmaster_gone_is_unavailable(pg_dsn: str) -> None:
    # A Citus coordinator whose postmaster dies under a delegated call answers with an ERROR
    # (XX000 "postmaster was shut down, exiting") while the worker may have committed: the
    # outcome is unknown, so it must read as an unavailable server (an OSError callers retry),
    # not as a refusal. Any other internal error still reaches the caller as it is.
    import asyncpg

    from tokencapture.postgres._client import Client

    client = Client(pg_dsn, pool_size=1, install_schema=True)
    raise_sql = "DO $$ BEGIN RAISE EXCEPTION '{}' USING ERRCODE = 'XX000'; END $$"
    with pytest.raises(PostgresUnavailableError, match="postmaster was shut down"):
        await client.fetch("val", raise_sql.format("postmaster was shut down, exiting"))
    with pytest.raises(asyncpg.exceptions.InternalServerError, match="something else"):
        await client.fetch("val", raise_sql.format("something else"))
    assert await client.fetch("val", "SELECT 1") == 1
    await client.close()


def test_a_client_keeps_one_batcher_per_loop_and_batched_statement() -> None:
    # Each store owns its client and batches one statement today; a second statement on the
    # same client and loop must still get a batcher of its own, never the first one's.
    from tokencapture.postgres._client import Client

    client = Client("postgresql://127.0.0.1:1/none")  # never connects: no call is made
    loop = asyncio.new_event_loop()
    other_loop = asyncio.new_event_loop()
    try:
        puts = client.batcher(loop, "SELECT 'put'", 8, None)
        stages = client.batcher(loop, "SELECT 'stage'", 8, None)
        assert (puts.sql, stages.sql) == ("SELECT 'put'", "SELECT 'stage'")
        assert client.batcher(loop, "SELECT 'put'", 8, None) is puts
        assert client.batcher(loop, "SELECT 'stage'", 8, None) is stages
        elsewhere = client.batcher(other_loop, "SELECT 'put'", 8, None)
        assert elsewhere is not puts and elsewhere.loop is other_loop
    finally:
        loop.close()
        other_loop.close()


# --- Lines the server cannot take in one put ------------------------------------------------


def test_a_line_over_the_limit_is_refused_when_put_is_called(
    store: PostgresTokenCaptureStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL holds at most 1 GiB in a field or a message (a larger one drops the
    connection): a put of a longer line is refused when called, naming the limit, and nothing
    is stored (the limit lowered to 4 KiB here)."""
    import tokencapture.postgres.store as pg_store

    assert pg_store._MAX_LINE_BYTES == (1 << 30) - (1 << 20)
    monkeypatch.setattr(pg_store, "_MAX_LINE_BYTES", 4096)
    big = make_entry(call="big", blob="x" * 5000)
    with pytest.raises(ValueError, match=r"is \d+ bytes as a line: PostgreSQL takes at most 4096"):
        store.put(big)  # when called: no coroutine to await
    store.append(make_entry(call="small"))
    assert [entry.model_call_id for entry in store.freeze_now("r1").entries] == ["small"]
    stats = store.stats()
    assert stats["put"]["count"] == 2 and stats["put"]["failures"] == 1


def test_a_line_too_large_to_batch_is_put_alone(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Puts waiting together share one message: a line so large that a full batch of such
    lines could pass the server's message limit goes alone (its own call and commit), and
    small lines still share batches (the thresholds lowered here)."""
    import tokencapture.postgres.store as pg_store
    from tokencapture.postgres import _client

    monkeypatch.setattr(pg_store, "_BATCHED_LINE_BYTES_PER_BATCH", 8 * 2048)
    batched: list[bytes] = []
    submit = _client.CallBatcher.submit

    def spy(self: _client.CallBatcher, args: Any) -> Any:
        batched.append(args[1])
        return submit(self, args)

    monkeypatch.setattr(_client.CallBatcher, "submit", spy)

    async def run() -> list[str]:
        pg = PostgresTokenCaptureStore(pg_dsn, install_schema=True, put_batch_size=8)
        try:
            await pg.put(make_entry(call="warm"))  # the client learns it is not on Citus
            await asyncio.gather(
                *(pg.put(make_entry(call=f"s{i}")) for i in range(6)),
                *(pg.put(make_entry(call=f"L{i}", blob="x" * 3000)) for i in range(6)),
            )
            snapshot = await pg.freeze("r1")
            return sorted(entry.model_call_id for entry in snapshot.entries)
        finally:
            await pg.close()

    stored = asyncio.run(run())
    assert stored == sorted(["warm", *(f"s{i}" for i in range(6)), *(f"L{i}" for i in range(6))])
    assert sorted(batched) == sorted(f"s{i}".encode() for i in range(6))
