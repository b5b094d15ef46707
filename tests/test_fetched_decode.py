"""`_core.decode_lines` and `_core.columns_of_log`: complete canonical lines (a log fetched from
PostgreSQL), one `bytes` per line as rows hand them over or joined into one buffer, decode to
exactly what the file store's read path builds from the same lines in a file, and damaged lines
are refused with the same words. No server is needed: the expected values come from the file
store reading the same bytes, and the digests from hashlib.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import uuid
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, given, settings
from tests.conftest import GOLDEN, make_entry
from tests.test_columnar import (
    DAMAGES,
    GOLDEN_ROLLOUTS,
    assert_rows_equal,
    damaged_pair,
    entries_of,
    lineage_rollout,
    outcome,
)

from tokencapture import _core
from tokencapture.postgres._decode import decode_columns, decode_entries
from tokencapture.protocols import TokenCaptureCorruptionError
from tokencapture.records import TokenEntry
from tokencapture.store import TokenCaptureStore


def complete_lines(log: bytes) -> bytes:
    """The log up to its last newline (what a PostgreSQL store holds: no torn tail)."""
    return log[: log.rfind(b"\n") + 1]


def digests_of(log: bytes) -> list[str]:
    return [hashlib.sha256(line).hexdigest() for line in log_lines(log)]


def log_lines(log: bytes) -> list[bytes]:
    """The lines of a buffer of complete lines, apart and without newlines (as rows hold them)."""
    assert log.endswith(b"\n") or not log
    return log.split(b"\n")[:-1]


def assert_decodes_like_the_file_store(store: TokenCaptureStore, rollout_id: str) -> bytes:
    """`decode_lines` of the rollout's complete lines equals `Store.read_lines` of the file,
    record for record and offset for offset, with and without the digests."""
    log = complete_lines(store.path_for(rollout_id).read_bytes())
    expected = store._native.read_lines(rollout_id)
    assert _core.decode_lines(log, digests_of(log), "x") == expected
    assert _core.decode_lines(log) == expected
    # The lines apart: the same records at the same offsets (those of the joined log).
    assert _core.decode_lines(log_lines(log), digests_of(log), "x") == expected
    assert _core.decode_lines(tuple(log_lines(log))) == expected
    joined = pa.table(_core.columns_of_log(log, digests_of(log)))
    assert pa.table(_core.columns_of_log(log_lines(log), digests_of(log))).equals(joined)
    return log


@pytest.mark.parametrize("rollout_id", GOLDEN_ROLLOUTS)
def test_golden_logs_decode_like_the_file_store(golden_store: Path, rollout_id: str) -> None:
    store = TokenCaptureStore(golden_store)
    log = assert_decodes_like_the_file_store(store, rollout_id)
    expected = json.loads((GOLDEN / "store-0.7.0.expected.json").read_text())[rollout_id]
    records, _ = _core.decode_lines(log, digests_of(log))
    if expected["entry_count"]:  # the reference's own reading of the same log
        assert [record["model_call_id"] for record in records] == expected["model_call_ids"]
    if len(records) == len(digests_of(log)):
        entries = decode_entries(log, digests_of(log), "x")
        assert entries == tuple(store.read_entries(rollout_id))
        assert_rows_equal(pa.table(decode_columns(log, digests_of(log), "x")), entries)


@given(entries=entries_of())
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_generated_logs_decode_like_the_file_store(
    entries: list[TokenEntry], tmp_path: Path
) -> None:
    store = TokenCaptureStore(tmp_path / f"gen-{uuid.uuid4().hex}")
    for entry in entries:
        store.append(entry)
    log = assert_decodes_like_the_file_store(store, "gen")
    assert decode_entries(log, digests_of(log), "x") == tuple(entries)
    assert decode_entries(log_lines(log), digests_of(log), "x") == tuple(entries)
    assert_rows_equal(pa.table(decode_columns(log, digests_of(log), "x")), entries)


@pytest.mark.parametrize("calls", [3, 14], ids=["small-log", "streamed-log"])
def test_agentic_logs_decode_like_the_file_store(tmp_path: Path, calls: int) -> None:
    """Past 256 KiB the buffer is taped on a second thread while this one builds."""
    store = TokenCaptureStore(tmp_path)
    entries = lineage_rollout("agentic", calls=calls, prompt=1500, turn=400, seed=calls)
    for entry in entries:
        store.append(entry)
    log = assert_decodes_like_the_file_store(store, "agentic")
    assert (len(log) >= 256 << 10) == (calls == 14)
    assert decode_entries(log, digests_of(log), "x") == tuple(entries)
    assert_rows_equal(pa.table(decode_columns(log, digests_of(log), "x")), entries)
    assert decode_entries(log_lines(log), digests_of(log), "x") == tuple(entries)
    assert_rows_equal(pa.table(decode_columns(log_lines(log), digests_of(log), "x")), entries)


@pytest.mark.parametrize(
    "damage", [*(d for d in DAMAGES if d != "duplicate-line"), "token-beyond-int64"]
)
@pytest.mark.parametrize("size", ["", "-large"])
def test_damaged_lines_are_refused_with_the_file_stores_words(
    tmp_path: Path, damage: str, size: str
) -> None:
    """A damaged line whose stored digest matches it (the digest checks cannot catch it) gets
    the refusal the file store's read gives the same line, with the source in place of the
    path; the columns refuse it as `read_columns` does."""
    objects, columns = damaged_pair(tmp_path, damage + size)
    path = objects.path_for("r")
    log = complete_lines(path.read_bytes())
    where = str(path).replace("/objects/", "/X/")
    expected = outcome(lambda: objects.read_entries("r"))
    got = outcome(lambda: decode_entries(log, digests_of(log), where))
    if expected[0] == "ok":
        assert got[0] == "ok"
        assert got[1] == tuple(expected[1])
    else:
        assert got == expected
    assert outcome(lambda: decode_entries(log_lines(log), digests_of(log), where)) == got
    expected_columns = outcome(lambda: pa.table(columns.read_columns("r")))
    got_columns = outcome(lambda: pa.table(decode_columns(log, digests_of(log), where)))
    if expected_columns[0] == "ok":
        assert got_columns[0] == "ok"
        assert got_columns[1].equals(expected_columns[1])
    else:
        assert got_columns == expected_columns
    lines = log_lines(log)
    got_from_lines = outcome(lambda: pa.table(decode_columns(lines, digests_of(log), where)))
    if got_columns[0] == "ok":
        assert got_from_lines[0] == "ok"
        assert got_from_lines[1].equals(got_columns[1])
    else:
        assert got_from_lines == got_columns


@pytest.mark.parametrize("size", [3, 14])
def test_the_stored_digests_and_the_line_count_are_checked(tmp_path: Path, size: int) -> None:
    store = TokenCaptureStore(tmp_path)
    for entry in lineage_rollout("r", calls=size, prompt=1500, turn=400, seed=1):
        store.append(entry)
    log = store.path_for("r").read_bytes()
    digests = digests_of(log)
    second = log.index(b"\n") + 1
    wrong = [digests[0], digests[0], *digests[2:]]
    lines = log_lines(log)
    last = len(log) - len(lines[-1]) - 1
    for decode, form in itertools.product((_core.decode_lines, _core.columns_of_log), (0, 1)):
        fetched = (log, lines)[form]
        with pytest.raises(
            TokenCaptureCorruptionError,
            match=(
                f"^src: the line does not match its payload digest {digests[0]} "
                rf"\(byte offset {second}\)$"
            ),
        ):
            decode(fetched, wrong, "src")
        with pytest.raises(
            TokenCaptureCorruptionError,
            match=rf"^src: the line does not match its payload digest 0+ \(byte offset {last}\)$",
        ):
            decode(fetched, [*digests[:-1], "0" * 64], "src")
        with pytest.raises(TokenCaptureCorruptionError, match=f"holds {size} lines but {size - 1}"):
            decode(fetched, digests[1:], "src")
        with pytest.raises(
            TokenCaptureCorruptionError,
            match=rf"^src: the last line has no newline.*\(byte offset {len(log)}\)$",
        ):
            decode(log + b'{"model_call_id":"torn"', None, "src")
    # A PostgreSQL log holds one line per call id: a repeated one is corruption there.
    line = orjson.dumps(make_entry("r", 1).model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)
    twice = line + b"\n" + line + b"\n"
    for decode_log in (decode_entries, decode_columns):
        with pytest.raises(TokenCaptureCorruptionError, match=r"^w: two stored lines share"):
            decode_log(twice, digests_of(twice), "w")


@pytest.mark.parametrize("size", [3, 14])
def test_a_line_holding_a_newline_is_corruption(tmp_path: Path, size: int) -> None:
    """Joined, such a line would be two: its offset is named (that of the joined log), with or
    without digests, even when its digest (recomputed here) matches it."""
    store = TokenCaptureStore(tmp_path)
    for entry in lineage_rollout("r", calls=size, prompt=1500, turn=400, seed=2):
        store.append(entry)
    lines = log_lines(store.path_for("r").read_bytes())
    second = lines[1].index(b",")
    lines[1] = lines[1][:second] + b"\n" + lines[1][second + 1 :]
    lines[-1] = lines[-1] + b"\n"
    digests = [hashlib.sha256(line).hexdigest() for line in lines]
    message = (
        rf"^src: the line holds a newline at column {second}: a stored line must be one line "
        rf"\(byte offset {len(lines[0]) + 1}\)$"
    )
    for decode in (_core.decode_lines, _core.columns_of_log):
        for stored in (digests, None):
            with pytest.raises(TokenCaptureCorruptionError, match=message):
                decode(lines, stored, "src")
    for decode_log in (decode_entries, decode_columns):
        with pytest.raises(TokenCaptureCorruptionError, match=message):
            decode_log(lines, digests, "src")


def test_empty_and_bad_arguments() -> None:
    assert _core.decode_lines(b"") == ([], [])
    assert _core.decode_lines(b"", []) == ([], [])
    assert _core.decode_lines([]) == ([], [])
    assert _core.decode_lines([], []) == ([], [])
    assert len(_core.columns_of_log(b"", [])) == 0
    assert len(_core.columns_of_log([], [])) == 0
    bad: Any = "not bytes"
    bad_logs: list[Any] = [bad, [bad], [b"{}", 1], None, 3]
    for bad_log in bad_logs:
        for decode in (_core.decode_lines, _core.columns_of_log):
            with pytest.raises(TypeError, match=r"^argument 'log': log must be bytes or a seq"):
                decode(bad_log)
    with pytest.raises(TypeError):
        _core.decode_lines(b"", bad)  # a str is not a sequence of digests
