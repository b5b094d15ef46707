"""`FileCaptureLedger`: write-once rows, manifests, fences, parent resolution, bad input.

Every test taking the `ledger` fixture runs twice: on `FileCaptureLedger` and on
`FileLineageStore`, which presents the same capture-ledger surface over the same files (NeMo
Gym configures its `FileLineageStore` as the `CaptureLedger`), with the same semantics.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import ValidationError
from tests.conftest import make_entry, sha

from tokencapture import (
    CaptureLedgerConflictError,
    FileCaptureLedger,
    TokenCaptureStore,
)
from tokencapture.fingerprint import assistant_fingerprint, conversation_digest
from tokencapture.lineage import FileLineageStore
from tokencapture.protocols import (
    CaptureLedger,
    LineageMatch,
    RolloutRetiredError,
    TokenCaptureCorruptionError,
)
from tokencapture.records import ParentResolutionStatus, compute_digest
from tokencapture.staging.records import (
    LEDGER_ROW_MISSING_CHAIN_HASH_REASON,
    LEDGER_ROW_MISSING_RESPONSE_ID_REASON,
    UNCOMMITTED_CALL_REASON,
    CallRecord,
    CaptureLedgerCommit,
    RolloutManifest,
    RolloutRemoval,
)

ROOT = ParentResolutionStatus.ROOT
RESOLVED = ParentResolutionStatus.RESOLVED
UNRESOLVED = ParentResolutionStatus.UNRESOLVED

Items = list[dict[str, Any]]


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def make_commit(
    call: str = "c1",
    rollout_id: str = "r1",
    *,
    request: Items | None = None,
    response: Items | None = None,
    parent: str | None = None,
    prev_len: int = 0,
    delta_len: int = 5,
    cumulative_hash: str | None = None,
    staging_chain: tuple[str, ...] = ("stage-a",),
    response_id: str | None = None,
    fingerprint_version: int = 2,
    admitted_at: float | None = 1_700_000_000.5,
) -> CaptureLedgerCommit:
    """A valid commit of NeMo Gym's schema (version-2 fingerprints, so it can resolve)."""
    request = [user("question")] if request is None else request
    response = [assistant(f"answer of {call}")] if response is None else response
    cum_len = prev_len + delta_len
    record = CallRecord(
        model_call_id=call,
        parent_call_id=parent,
        prev_len=prev_len,
        delta_len=delta_len,
        cum_len=cum_len,
        weight_version=3,
        digest=sha(f"staged-{call}"),
        extras_digest=sha(f"extras-{call}"),
        staging_key=f"{rollout_id}/{call}",
        mode="token_in" if parent else "text",
        chain_hash=sha(f"chain-{call}"),
        cumulative_hash=cumulative_hash or compute_digest(list(range(cum_len))),
        response_id=response_id or f"resp-{call}",
        admitted_at=admitted_at,
        output_fingerprint=sha(f"output-{call}"),
        fingerprint_version=fingerprint_version,
    )
    return CaptureLedgerCommit(
        rollout_id=rollout_id,
        record=record,
        staging_chain=staging_chain,
        request_items=request,
        response_items=response,
    )


def expected_row(commit: CaptureLedgerCommit) -> dict[str, Any]:
    """The documented commit row (docs/compat-ledger.md), column by column."""
    record = commit.record
    request = list(commit.request_items)
    return {
        "admitted_at": record.admitted_at,
        "chain_hash": record.chain_hash,
        "context_digest": conversation_digest(request),
        "context_len": len(request),
        "continuation_fingerprint": record.continuation_fingerprint,
        "cum_len": record.cum_len,
        "cumulative_hash": record.cumulative_hash,
        "delta_len": record.delta_len,
        "digest": record.cumulative_hash,
        "extras_digest": record.extras_digest,
        "fingerprint": assistant_fingerprint([*request, *commit.response_items]),
        "fingerprint_version": record.fingerprint_version,
        "mode": record.mode,
        "model_call_id": record.model_call_id,
        "output_fingerprint": record.output_fingerprint,
        "parent_call_id": record.parent_call_id,
        "prev_len": record.prev_len,
        "response_id": record.response_id,
        "staging_chain": list(commit.staging_chain),
        "staging_digest": record.digest,
        "staging_key": record.staging_key,
        "weight_version": record.weight_version,
    }


def row_line(commit: CaptureLedgerCommit) -> bytes:
    """Sorted keys, compact separators, non-ASCII escaped (Python's json.dumps defaults)."""
    return json.dumps(expected_row(commit), sort_keys=True, separators=(",", ":")).encode()


def failure_line(call: str, reason: str) -> bytes:
    row = {"model_call_id": call, "failure_reason": reason}
    return json.dumps(row, sort_keys=True, separators=(",", ":")).encode()


def listing(root: Path) -> list[str]:
    """The directory's file names (none before it exists: `FileLineageStore` creates it on its
    first ledger write, `FileCaptureLedger` when it is made)."""
    return sorted(path.name for path in root.iterdir()) if root.exists() else []


def validated(manifest: dict[str, Any]) -> RolloutManifest:
    """The manifest validates as `RolloutManifest` and carries no token arrays."""
    assert "token_ids" not in orjson.dumps(manifest).decode()
    return RolloutManifest.model_validate(manifest)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ledger"


Ledger = FileCaptureLedger | FileLineageStore


@pytest.fixture(params=[FileCaptureLedger, FileLineageStore])
def ledger(root: Path, request: pytest.FixtureRequest) -> Ledger:
    surface: Ledger = request.param(root)
    return surface


def rows_path(ledger: Ledger, rollout_id: str) -> Path:
    """The rollout's ledger rows, `R.lineage.jsonl`."""
    return Path(ledger.root) / f"{rollout_id}.lineage.jsonl"


def fence_path(ledger: Ledger, rollout_id: str) -> Path:
    """The rollout's fence, `R.lineage.retired`."""
    return Path(ledger.root) / f"{rollout_id}.lineage.retired"


def lock_path(ledger: Ledger, rollout_id: str) -> Path:
    """The per-rollout lock shared with the token store, `R.tokens.lock`."""
    return Path(ledger.root) / f"{rollout_id}.tokens.lock"


# ---- protocol, rows, replay ------------------------------------------------------------------


async def test_implements_the_capture_ledger_protocol(ledger: Ledger) -> None:
    assert isinstance(ledger, CaptureLedger)
    assert ledger.is_process_shared() is True
    await ledger.close()
    await ledger.close()  # idempotent, and the ledger stays usable
    await ledger.record(make_commit())
    assert await ledger.has_rows("r1")


async def test_record_writes_one_sorted_compact_row_and_a_token_free_manifest(
    ledger: Ledger, root: Path
) -> None:
    commit = make_commit(staging_chain=("stage-a", "stage-b"))
    assert not await ledger.has_rows("r1")
    await ledger.record(commit)
    assert rows_path(ledger, "r1").read_bytes() == row_line(commit) + b"\n"
    assert listing(root) == ["r1.lineage.jsonl", "r1.tokens.lock"]
    manifest = await ledger.manifest("r1")
    assert manifest == {
        "schema_version": 2,
        "rollout_id": "r1",
        "records": [commit.record.model_dump(mode="json")],
        "failures": [],
    }
    assert validated(manifest).records == [commit.record]
    assert await ledger.has_rows("r1")


async def test_identical_replay_is_a_no_op_and_a_different_row_conflicts(
    ledger: Ledger,
) -> None:
    commit = make_commit()
    await ledger.record(commit)
    await ledger.record(commit)
    assert ledger.record_now(commit) is True
    before = rows_path(ledger, "r1").read_bytes()
    assert before.count(b"\n") == 1

    different = make_commit(response_id="another-response")
    with pytest.raises(CaptureLedgerConflictError, match="already recorded"):
        await ledger.record(different)
    with pytest.raises(CaptureLedgerConflictError):
        ledger.record_now(different)
    assert issubclass(CaptureLedgerConflictError, ValueError)
    assert rows_path(ledger, "r1").read_bytes() == before
    # The conflict changed nothing: the first row still resolves.
    found = await ledger.resolve("r1", [user("question"), assistant("answer of c1"), user("more")])
    assert found.match is not None and found.match.model_call_id == "c1"


async def test_failure_rows_are_listed_deduplicated_and_never_resolve(
    ledger: Ledger,
) -> None:
    await ledger.record_failure("r1", "c1", UNCOMMITTED_CALL_REASON)
    await ledger.record_failure("r1", "c1", UNCOMMITTED_CALL_REASON)  # no-op
    assert ledger.record_failure_now("r1", "c1", "staging_lost") is True
    assert rows_path(ledger, "r1").read_bytes() == (
        failure_line("c1", UNCOMMITTED_CALL_REASON)
        + b"\n"
        + failure_line("c1", "staging_lost")
        + b"\n"
    )
    assert failure_line("c1", "x") == b'{"failure_reason":"x","model_call_id":"c1"}'
    manifest = await ledger.manifest("r1")
    assert validated(manifest).failures[0].reason == UNCOMMITTED_CALL_REASON
    assert [f["reason"] for f in manifest["failures"]] == [UNCOMMITTED_CALL_REASON, "staging_lost"]
    assert manifest["records"] == []
    assert await ledger.has_rows("r1")
    # The first row of a call id decides: a commit after its failure row conflicts.
    with pytest.raises(CaptureLedgerConflictError):
        await ledger.record(make_commit("c1"))

    # A failure row after a commit is listed too; like NeMo Gym, it does not stop the commit
    # row from resolving (the failure poisons the whole rollout at finalization anyway).
    await ledger.record(make_commit("c2"))
    continuation = [user("question"), assistant("answer of c2"), user("next")]
    assert (await ledger.resolve("r1", continuation)).status is RESOLVED
    await ledger.record_failure("r1", "c2", "staging_lost")
    assert (await ledger.resolve("r1", continuation)).status is RESOLVED
    manifest = await ledger.manifest("r1")
    assert [r["model_call_id"] for r in validated(manifest).model_dump()["records"]] == ["c2"]
    assert [f["model_call_id"] for f in manifest["failures"]] == ["c1", "c1", "c2"]
    # Non-ASCII text is escaped as Python's json.dumps escapes it.
    await ledger.record_failure("r1", "c3", "d\u00e9j\u00e0 \U0001f600")
    last = rows_path(ledger, "r1").read_bytes().splitlines()[-1]
    assert last == b'{"failure_reason":"d\\u00e9j\\u00e0 \\ud83d\\ude00","model_call_id":"c3"}'


# ---- poison rows, torn and corrupt lines -----------------------------------------------------


def write_rows(path: Path, rows: list[dict[str, Any]], tail: bytes = b"") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(row, sort_keys=True, separators=(",", ":")).encode() + b"\n" for row in rows
    ]
    path.write_bytes(b"".join(lines) + tail)


def changed_row(call: str, **changes: Any) -> dict[str, Any]:
    """The row of `make_commit(call)` with columns changed (`...` removes one)."""
    row = expected_row(make_commit(call))
    for key, value in changes.items():
        if value is ...:
            del row[key]
        else:
            row[key] = value
    return row


async def test_rows_are_read_by_nemo_gyms_rules(ledger: Ledger) -> None:
    lineage_only = {
        "model_call_id": "local",
        "fingerprint": sha("x"),
        "fingerprint_version": 2,
        "context_len": 0,
        "context_digest": "",
        "digest": sha("d"),
    }
    rows = [
        changed_row("no-response", response_id=...),
        changed_row("null-response", response_id=None),
        changed_row("empty-response", response_id=""),
        changed_row("no-chain", chain_hash=...),
        changed_row("null-cumulative", cumulative_hash=None),
        lineage_only,  # no staging_key and no failure_reason: not part of a manifest
        changed_row("float-lengths", prev_len=0.0, delta_len=5.9, cum_len=5),  # int() truncates
        changed_row("good"),
        {"model_call_id": 7, "failure_reason": 404},  # listed through str()
        changed_row("null-staging", staging_key=None, failure_reason=None),
    ]
    write_rows(rows_path(ledger, "r1"), rows)
    assert await ledger.has_rows("r1")
    parsed = validated(await ledger.manifest("r1"))
    assert [r.model_call_id for r in parsed.records] == ["float-lengths", "good"]
    assert parsed.records[0].delta_len == 5
    assert parsed.records[1] == make_commit("good").record
    assert [(f.model_call_id, f.reason) for f in parsed.failures] == [
        ("no-response", LEDGER_ROW_MISSING_RESPONSE_ID_REASON),
        ("null-response", LEDGER_ROW_MISSING_RESPONSE_ID_REASON),
        ("empty-response", LEDGER_ROW_MISSING_RESPONSE_ID_REASON),
        ("no-chain", LEDGER_ROW_MISSING_CHAIN_HASH_REASON),
        ("null-cumulative", LEDGER_ROW_MISSING_CHAIN_HASH_REASON),
        ("7", "404"),
    ]
    # Every commit row shares the request, but each has its own response: one candidate each.
    good = await ledger.resolve("r1", [user("question"), assistant("answer of good")])
    assert good.match is not None and good.match.model_call_id == "good"
    poisoned = await ledger.resolve("r1", [user("question"), assistant("answer of no-chain")])
    assert poisoned.match is not None and poisoned.match.chain_hash == ""


async def test_a_row_the_manifest_cannot_read_is_corruption(ledger: Ledger) -> None:
    good = row_line(make_commit("c1"))
    bad = json.dumps(changed_row("c2", cum_len=99), sort_keys=True).encode()
    rows_path(ledger, "r1").parent.mkdir(parents=True, exist_ok=True)
    rows_path(ledger, "r1").write_bytes(good + b"\n" + bad + b"\n")
    offset = len(good) + 1
    with pytest.raises(TokenCaptureCorruptionError, match=rf"r1\.lineage\.jsonl.*offset {offset}"):
        await ledger.manifest("r1")
    # Its own continuation cannot be read either (no context_len: NeMo Gym raises KeyError).
    write_rows(rows_path(ledger, "r2"), [changed_row("c3", context_len=...)])
    with pytest.raises(TokenCaptureCorruptionError, match="context_len"):
        await ledger.resolve("r2", [user("question"), assistant("answer of c3")])


# Request content only the conversation digest reads (a user turn's): the fingerprint accepts it,
# so the digest is computed for the candidate row, and refuses it.
DIGEST_ONLY_BAD_USER_TURNS = [
    {"role": "user", "content": 5},  # ValueError
    {"role": "user", "content": "lone \ud800"},  # UnicodeEncodeError (a ValueError)
    {"role": "user", "content": "q", "tool_calls": [5]},  # TypeError
]


def digest_error(items: list[Any]) -> Exception:
    """What `conversation_digest` raises for these items (the request's own error)."""
    with pytest.raises((ValueError, TypeError)) as raised:
        conversation_digest(items)
    return raised.value


@pytest.mark.parametrize("bad_turn", DIGEST_ONLY_BAD_USER_TURNS)
async def test_request_content_the_context_digest_refuses_is_the_requests_error(
    ledger: Ledger, bad_turn: dict[str, Any]
) -> None:
    commit = make_commit("c1", request=[user("question")])
    await ledger.record(commit)
    items = [bad_turn, assistant("answer of c1")]
    # The row is the request's candidate: the fingerprint reads only the assistant turn.
    assert assistant_fingerprint(items) == expected_row(commit)["fingerprint"]
    expected = digest_error(items[:1])
    assert not isinstance(expected, TokenCaptureCorruptionError)
    for resolve in (ledger.resolve, ledger.resolve_now):
        with pytest.raises((ValueError, TypeError)) as raised:
            result = resolve("r1", items)
            if asyncio.iscoroutine(result):
                await result
        assert type(raised.value) is type(expected), resolve
        assert str(raised.value) == str(expected)
    # The same request with good content resolves the row: nothing was wrong with it.
    found = await ledger.resolve("r1", [user("question"), assistant("answer of c1")])
    assert found.match is not None and found.match.model_call_id == "c1"


async def test_a_damaged_candidate_row_is_still_corruption(ledger: Ledger) -> None:
    request = [user("question"), assistant("answer of c1")]
    damaged = [
        changed_row("c1", context_len="two"),  # int() raises ValueError: the row's
        changed_row("c1", context_len=[1]),  # TypeError
        changed_row("c1", context_digest=...),  # KeyError, after the context digest
        changed_row("c1", digest=...),  # the context matches; the match cannot be built
    ]
    for index, row in enumerate(damaged):
        rollout = f"damaged-{index}"
        write_rows(rows_path(ledger, rollout), [row])
        for resolve in (ledger.resolve, ledger.resolve_now):
            with pytest.raises(TokenCaptureCorruptionError, match=r"cannot be read.*offset 0"):
                result = resolve(rollout, request)
                if asyncio.iscoroutine(result):
                    await result
    # A row whose context_len cannot be read is damaged whatever the request holds: read first.
    with pytest.raises(TokenCaptureCorruptionError, match="ValueError"):
        await ledger.resolve("damaged-0", [{"role": "user", "content": 5}, request[1]])


async def test_torn_final_line_is_ignored_then_truncated_by_the_next_write(
    ledger: Ledger,
) -> None:
    first = make_commit("c1")
    torn = row_line(make_commit("c-torn"))[:40]
    rows_path(ledger, "r1").parent.mkdir(parents=True, exist_ok=True)
    rows_path(ledger, "r1").write_bytes(row_line(first) + b"\n" + torn)
    manifest = await ledger.manifest("r1")
    assert [r["model_call_id"] for r in manifest["records"]] == ["c1"]
    second = make_commit("c2")
    await ledger.record(second)
    assert (
        rows_path(ledger, "r1").read_bytes() == row_line(first) + b"\n" + row_line(second) + b"\n"
    )


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b"[1,2]",
        b'"a string"',
        b"NaN",
        b'{"failure_reason":"no call id"}',
        b'{"kind":"failure","model_call_id":"c","reason":"x"}',  # our pre-compat format
    ],
)
async def test_a_corrupt_complete_line_raises_and_blocks_writes(
    ledger: Ledger, line: bytes
) -> None:
    good = row_line(make_commit("c1"))
    content = good + b"\n" + line + b"\n"
    write_rows(rows_path(ledger, "r1"), [])
    rows_path(ledger, "r1").write_bytes(content)
    with pytest.raises(TokenCaptureCorruptionError, match=r"r1\.lineage\.jsonl.*offset"):
        await ledger.manifest("r1")
    with pytest.raises(TokenCaptureCorruptionError):
        await ledger.record(make_commit("c2"))
    assert rows_path(ledger, "r1").read_bytes() == content


# ---- visibility across processes -------------------------------------------------------------

RECORD_IN_CHILD = textwrap.dedent(
    """
    import sys
    from tests.test_ledger import make_commit
    from tokencapture import FileCaptureLedger

    ledger = FileCaptureLedger(sys.argv[1])
    ledger.record_now(make_commit(sys.argv[2], request=[{"role": "user", "content": "hi"}]))
    ledger.record_failure_now("r1", "lost-call", "engine_crashed")
    """
)


def test_a_record_in_another_process_is_visible_to_an_existing_ledger(
    ledger: Ledger, root: Path
) -> None:
    # The parent's ledger has already read (and cached) the rollout before the child writes.
    ledger.record_now(make_commit("c0"))
    assert [r["model_call_id"] for r in ledger.manifest_now("r1")["records"]] == ["c0"]
    continuation = [{"role": "user", "content": "hi"}, assistant("answer of c1"), user("more")]
    assert ledger.resolve_now("r1", continuation).status is UNRESOLVED

    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", RECORD_IN_CHILD, str(root), "c1"], check=True, cwd=repo)
    manifest = validated(ledger.manifest_now("r1"))
    assert [r.model_call_id for r in manifest.records] == ["c0", "c1"]
    assert [(f.model_call_id, f.reason) for f in manifest.failures] == [
        ("lost-call", "engine_crashed")
    ]
    found = ledger.resolve_now("r1", continuation)
    assert found.match is not None and found.match.model_call_id == "c1"


def concurrent_writer(root: str, index: int) -> None:
    ledger = FileCaptureLedger(root)
    for n in range(15):
        commit = make_commit(f"w{index}-c{n}", "shared")
        ledger.record_now(commit)
        ledger.record_now(commit)  # an identical retry is a no-op
        ledger.record_now(make_commit("common", "shared"))  # every writer, one row


def test_concurrent_processes_write_each_row_once(root: Path) -> None:
    FileCaptureLedger(root)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.starmap(concurrent_writer, [(str(root), 0), (str(root), 1)])
    manifest = validated(FileCaptureLedger(root).manifest_now("shared"))
    assert not manifest.failures
    assert len(manifest.records) == 31
    assert (root / "shared.lineage.jsonl").read_bytes().count(b"\n") == 31


async def test_concurrent_async_records_in_one_process(ledger: Ledger) -> None:
    commits = [make_commit(f"c{n}", f"r{n % 3}") for n in range(30)]
    await asyncio.gather(*(ledger.record(c) for c in commits + commits))
    for rollout in ("r0", "r1", "r2"):
        manifest = validated(await ledger.manifest(rollout))
        assert len(manifest.records) == 10
        assert rows_path(ledger, rollout).read_bytes().count(b"\n") == 10


# ---- parent resolution -----------------------------------------------------------------------


async def test_resolution_returns_a_token_free_match(ledger: Ledger) -> None:
    turn1 = [user("solve it")]
    out1 = [assistant("thinking"), {"type": "function_call", "call_id": "t1", "name": "calc"}]
    root_commit = make_commit("c1", request=turn1, response=out1, staging_chain=("s1",))
    await ledger.record(root_commit)
    turn2 = [*turn1, *out1, {"type": "function_call_output", "call_id": "t1", "output": "4"}]
    found = await ledger.resolve("r1", turn2)
    record = root_commit.record
    assert found.status is RESOLVED
    assert found.match == LineageMatch(
        model_call_id="c1",
        cumulative_token_ids=(),
        digest=record.cumulative_hash,
        staging_chain=("s1",),
        prev_len=record.cum_len,
        chain_hash=record.chain_hash,
    )
    # The child, recorded on top of its parent, resolves the next turn in turn.
    out2 = [assistant("the answer is 4")]
    child = make_commit(
        "c2",
        request=turn2,
        response=out2,
        parent="c1",
        prev_len=record.cum_len,
        staging_chain=("s1", "s2"),
    )
    await ledger.record(child)
    found = await ledger.resolve("r1", [*turn2, *out2, user("thanks")])
    assert found.match is not None
    assert (found.match.model_call_id, found.match.staging_chain) == ("c2", ("s1", "s2"))
    assert found.match.prev_len == child.record.cum_len


async def test_a_request_without_model_history_is_root_and_reads_nothing(
    ledger: Ledger, root: Path
) -> None:
    before = listing(root)
    found = await ledger.resolve("never-written", [user("hello"), {"role": "system"}])
    assert found.status is ROOT and found.match is None
    assert listing(root) == before


async def test_context_must_be_verified(ledger: Ledger) -> None:
    await ledger.record(make_commit("c1", request=[user("q1"), user("q1b")]))
    # Same model-authored history, different earlier context: no match.
    changed = [user("q1"), user("DIFFERENT"), assistant("answer of c1")]
    found = await ledger.resolve("r1", changed)
    assert (found.status, found.reason) == (UNRESOLVED, "no_match")
    # Context longer than the request: no match either.
    short = [assistant("answer of c1")]
    assert (await ledger.resolve("r1", short)).reason == "no_match"
    # An unknown rollout, and an unknown history, are no_match.
    assert (await ledger.resolve("other", changed)).reason == "no_match"
    exact = [user("q1"), user("q1b"), assistant("answer of c1")]
    assert (await ledger.resolve("r1", exact)).status is RESOLVED


async def test_a_fingerprint_on_several_rows_resolves_nothing(ledger: Ledger) -> None:
    # NeMo Gym's rule: exactly one row may carry the fingerprint; identical retries do not
    # collapse and several rows are "no_match", not "ambiguous".
    request, response = [user("q")], [assistant("same output")]
    digest = compute_digest([1, 2, 3, 4, 5])
    await ledger.record(make_commit("retry-a", request=request, response=response))
    found = await ledger.resolve("r1", [*request, *response, user("next")])
    assert found.match is not None and found.match.model_call_id == "retry-a"
    await ledger.record(
        make_commit("retry-b", request=request, response=response, cumulative_hash=digest)
    )
    found = await ledger.resolve("r1", [*request, *response, user("next")])
    assert (found.status, found.reason) == (UNRESOLVED, "no_match")


async def test_only_current_fingerprint_versions_resolve(ledger: Ledger) -> None:
    await ledger.record(make_commit("c1", fingerprint_version=0))
    request = [user("question"), assistant("answer of c1")]
    assert (await ledger.resolve("r1", request)).reason == "no_match"
    # ...and they do not count against a current row with the same fingerprint.
    await ledger.record(make_commit("c1", "r2", fingerprint_version=1))
    await ledger.record(
        make_commit("c2", "r2", response=[assistant("answer of c1")], response_id="x")
    )
    found = await ledger.resolve("r2", request)
    assert found.match is not None and found.match.model_call_id == "c2"


async def test_resolution_hashes_non_plain_items_in_python(ledger: Ledger) -> None:
    class Text(str):
        pass

    await ledger.record(make_commit("c1"))
    request = [user("question"), {"role": "assistant", "content": Text("answer of c1")}]
    found = await ledger.resolve("r1", request)
    assert found.match is not None and found.match.model_call_id == "c1"


# ---- retire and delete -----------------------------------------------------------------------


async def test_retire_fences_the_rollout(ledger: Ledger, root: Path) -> None:
    await ledger.record(make_commit("c1"))
    await ledger.record_failure("r2", "x", "boom")
    removal = await ledger.retire(["r1", "r2", "r1", "never"])
    assert removal == {"removed": ["r1", "r2"], "absent": ["never"]}
    RolloutRemoval.model_validate(removal)
    assert not rows_path(ledger, "r1").exists()
    assert fence_path(ledger, "r1").read_bytes() == b""
    assert fence_path(ledger, "never").exists()

    with pytest.raises(RolloutRetiredError, match="retired"):
        await ledger.manifest("r1")
    with pytest.raises(RolloutRetiredError):
        await ledger.has_rows("never")
    # Later writes are discarded silently and leave no rows.
    before = listing(root)
    await ledger.record(make_commit("c2"))
    await ledger.record_failure("r1", "c3", "late")
    assert ledger.record_now(make_commit("c4")) is False
    assert ledger.record_failure_now("r1", "c5", "late") is False
    assert listing(root) == before
    found = await ledger.resolve("r1", [user("question"), assistant("answer of c1")])
    assert (found.status, found.reason) == (UNRESOLVED, "no_match")
    # Retiring again is a no-op.
    assert await ledger.retire(["r1"]) == {"removed": [], "absent": ["r1"]}
    assert listing(root) == before


async def test_a_fence_left_with_rows_by_a_crash_still_reads_as_retired(
    ledger: Ledger,
) -> None:
    # A crash between retire's phases: the fence is durable, the rows not yet removed.
    await ledger.record(make_commit("c1"))
    fence_path(ledger, "r1").touch()
    with pytest.raises(RolloutRetiredError):
        await ledger.manifest("r1")
    assert ledger.record_now(make_commit("c2")) is False
    assert await ledger.retire(["r1"]) == {"removed": ["r1"], "absent": []}


async def test_delete_clears_rows_and_fences_so_the_id_can_be_reused(
    ledger: Ledger, root: Path
) -> None:
    await ledger.record(make_commit("c1"))
    await ledger.retire(["r1"])
    removal = await ledger.delete(["r1", "never"])
    assert removal == {"removed": ["r1"], "absent": ["never"]}
    RolloutRemoval.model_validate(removal)
    assert listing(root) == []
    assert await ledger.has_rows("r1") is False
    assert validated(await ledger.manifest("r1"))
    assert listing(root) == []  # reading an unused id creates nothing
    # Reuse: the new execution starts from an empty ledger, so even a differing row is new.
    reused = make_commit("c1", response_id="second-execution")
    await ledger.record(reused)
    assert (await ledger.manifest("r1"))["records"] == [reused.record.model_dump(mode="json")]
    assert await ledger.delete(["r1"]) == {"removed": ["r1"], "absent": []}
    assert await ledger.delete(["r1"]) == {"removed": [], "absent": ["r1"]}
    assert listing(root) == []


async def test_shares_the_directory_and_lock_with_the_token_store(root: Path) -> None:
    store = TokenCaptureStore(root)
    ledger = FileCaptureLedger(root)
    await store.put(make_entry("r1", call=1))
    await ledger.record(make_commit("c1"))
    assert lock_path(ledger, "r1") == store.lock_path_for("r1")
    await ledger.delete(["r1"])
    # The token store's files (and their lock) are untouched (a first put writes no state
    # index: the log and the lock are all it has).
    assert listing(root) == ["r1.tokens.jsonl", "r1.tokens.lock"]
    assert [e.model_call_id for e in (await store.freeze("r1")).entries] == ["call-1"]


# ---- bad input -------------------------------------------------------------------------------


def bad_calls(ledger: Ledger) -> list[tuple[type[Exception], Any]]:
    valid = make_commit()
    invalid_record = CaptureLedgerCommit.model_construct(
        rollout_id="r1",
        record=CallRecord.model_construct(**{**valid.record.model_dump(), "cum_len": 3}),
        staging_chain=(),
        request_items=valid.request_items,
        response_items=valid.response_items,
    )
    mutated = make_commit()
    mutated.record.prev_len = -1  # the models are mutable, as NeMo Gym's are
    empty_stage = valid.model_copy(update={"staging_chain": ("",)})
    bad_commit = valid.model_dump()
    bad_commit["record"]["digest"] = "XYZ"
    return [
        (TypeError, lambda: ledger.record_now(123)),  # type: ignore[arg-type]
        (ValidationError, lambda: ledger.record_now({"rollout_id": "r1"})),
        (ValidationError, lambda: ledger.record_now(bad_commit)),
        (ValueError, lambda: ledger.record_now(make_commit(rollout_id="bad/id"))),
        (ValueError, lambda: ledger.record_now(make_commit(rollout_id="x" * 300))),
        (ValueError, lambda: ledger.record_now(invalid_record)),
        (ValueError, lambda: ledger.record_now(mutated)),
        (ValueError, lambda: ledger.record_now(empty_stage)),
        (ValueError, lambda: ledger.record_failure_now("r1", "", "reason")),
        (ValueError, lambda: ledger.record_failure_now("r1", "c1", "")),
        (ValueError, lambda: ledger.record_failure_now("r1", "c\ud800", "reason")),
        (ValueError, lambda: ledger.record_failure_now("bad id", "c1", "reason")),
        (TypeError, lambda: ledger.record_failure_now("r1", 7, "reason")),  # type: ignore[arg-type]
        (TypeError, lambda: ledger.record_failure_now(None, "c1", "reason")),  # type: ignore[arg-type]
        (TypeError, lambda: ledger.retire_now("r1")),
        (TypeError, lambda: ledger.delete_now(b"r1")),  # type: ignore[arg-type]
        (ValueError, lambda: ledger.retire_now(["r1", "bad/id"])),
        (ValueError, lambda: ledger.delete_now(["r1", ""])),
        (TypeError, lambda: ledger.retire_now(["r1", 5])),  # type: ignore[list-item]
        (ValueError, lambda: ledger.manifest_now("../escape")),
        (TypeError, lambda: ledger.has_rows_now(5)),  # type: ignore[arg-type]
        (ValueError, lambda: ledger.resolve_now("a b", [assistant("x")])),
        (ValueError, lambda: ledger.resolve_now("r1", ["not a dict"])),  # type: ignore[list-item]
    ]


async def test_bad_input_is_refused_and_writes_nothing(ledger: Ledger, root: Path) -> None:
    await ledger.record(make_commit("existing", "r0"))
    await ledger.retire(["retired"])
    before = {path.name: path.read_bytes() for path in root.iterdir()}
    for error, call in bad_calls(ledger):
        with pytest.raises(error):
            call()
    with pytest.raises(TypeError):
        await ledger.retire("r1")
    with pytest.raises(ValueError, match="rollout_id"):
        await ledger.delete(["ok", "no spaces"])
    with pytest.raises(TypeError):
        await ledger.record("not a commit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must not be empty"):
        await ledger.record_failure("r1", "", "x")
    assert {path.name: path.read_bytes() for path in root.iterdir()} == before
    # Empty batches change nothing either.
    assert await ledger.retire([]) == {"removed": [], "absent": []}
    assert await ledger.delete([]) == {"removed": [], "absent": []}
    assert {path.name: path.read_bytes() for path in root.iterdir()} == before


def test_a_foreign_model_or_a_dict_is_revalidated(ledger: Ledger) -> None:
    commit = make_commit()
    assert ledger.record_now(commit.model_dump()) is True
    assert ledger.record_now(commit.model_dump(mode="json")) is True  # same row: a no-op
    assert rows_path(ledger, "r1").read_bytes().count(b"\n") == 1


async def test_passes_the_ledger_conformance_checks(root: Path) -> None:
    from tokencapture.conformance import run_conformance
    from tokencapture.lineage import FileLineageStore

    store = TokenCaptureStore(root)
    passed = await run_conformance(
        lambda: store,
        lambda: store,
        lambda: FileLineageStore(root),
        lambda: FileCaptureLedger(root),
    )
    assert {
        "ledger_round_trip",
        "ledger_replay_and_conflict",
        "ledger_failure_rows",
        "ledger_fence_after_retire",
        "ledger_reuse_after_delete",
    } <= set(passed)
