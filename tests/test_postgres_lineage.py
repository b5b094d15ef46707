"""`PostgresLineageStore` gives `FileLineageStore`'s answers on the same entries, sees puts from
other processes, starts over after retire and delete, and passes the lineage conformance."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.postgres_fixture import dsn, pg_dsn, pg_server
from tests.test_conformance import LINEAGE_CHECKS, STORE_CHECKS

from tokencapture.conformance import run_conformance
from tokencapture.lineage import FileLineageStore, encode_delta, stamp_continuation
from tokencapture.postgres import (
    PostgresLineageStore,
    PostgresTokenCaptureStore,
)
from tokencapture.protocols import LineageResolution, ParentResolutionStatus
from tokencapture.store import TokenCaptureStore

__all__ = ["dsn", "pg_dsn", "pg_server"]

BENCHES = Path(__file__).resolve().parents[1] / "benches"
if str(BENCHES) not in sys.path:
    sys.path.insert(0, str(BENCHES))

from bench_data import AgenticShape, conversation_rollouts  # noqa: E402


@pytest.fixture
def stores(
    dsn: str, tmp_path: Path
) -> Iterator[tuple[TokenCaptureStore, PostgresTokenCaptureStore, PostgresLineageStore]]:
    pg = PostgresTokenCaptureStore(dsn)
    lineage = PostgresLineageStore(dsn, max_cached_rollouts=2)
    yield TokenCaptureStore(tmp_path / "files"), pg, lineage
    pg.close_sync()
    lineage.close_sync()


def _answer(resolution: LineageResolution) -> tuple[object, ...]:
    match = resolution.match
    return (
        resolution.status,
        resolution.reason,
        None if match is None else (match.model_call_id, match.cumulative_token_ids, match.digest),
    )


def test_same_answers_as_the_file_lineage_store(
    stores: tuple[TokenCaptureStore, PostgresTokenCaptureStore, PostgresLineageStore],
    tmp_path: Path,
) -> None:
    files, pg, lineage = stores
    file_lineage = FileLineageStore(files.root)
    shape = AgenticShape(
        rollouts=3,
        calls=5,
        first_prompt_tokens=60,
        new_tokens_per_turn=20,
        generated_tokens=8,
        in_flight=1,
    )
    data = conversation_rollouts(shape)
    resolved = 0
    for c in range(shape.calls):
        for r in range(shape.rollouts):  # interleaved: the resolver's LRU (2) evicts and refetches
            entry = stamp_continuation(data.rollouts[r][c], data.requests[r][c])
            if c:  # store the prompt as a delta of the previous call where it extends it
                parent = file_lineage.resolve_now(entry.rollout_id, data.requests[r][c])
                if parent.status is ParentResolutionStatus.RESOLVED:
                    entry = encode_delta(entry, parent)
            files.append(entry)
            pg.append(entry)
            for request in (data.continuations[r][c], data.requests[r][c], []):
                expected = file_lineage.resolve_now(entry.rollout_id, request)
                got = lineage.resolve_now(entry.rollout_id, request)
                assert _answer(got) == _answer(expected)
                resolved += expected.status is ParentResolutionStatus.RESOLVED
    assert resolved >= shape.calls * shape.rollouts  # the continuations all resolve
    # A duplicate call id with the same fingerprint from another rollout's data: ambiguity
    # and conflicts are the native matcher's rules, shared; retire and delete start over.
    rollout_id = data.rollouts[0][0].rollout_id
    request = data.continuations[0][shape.calls - 1]
    assert lineage.resolve_now(rollout_id, request).status is ParentResolutionStatus.RESOLVED
    files.retire_now([rollout_id])
    pg.retire_now([rollout_id])
    assert _answer(lineage.resolve_now(rollout_id, request)) == _answer(
        file_lineage.resolve_now(rollout_id, request)
    )
    files.delete_now([rollout_id])
    pg.delete_now([rollout_id])
    first = stamp_continuation(data.rollouts[0][0].model_copy(), data.requests[0][0])
    files.append(first)
    pg.append(first)
    for request in (data.continuations[0][0], data.continuations[0][2]):
        assert _answer(lineage.resolve_now(rollout_id, request)) == _answer(
            file_lineage.resolve_now(rollout_id, request)
        )
    asyncio.run(file_lineage.close())


def test_a_put_from_another_process_is_visible_to_an_existing_resolver(dsn: str) -> None:
    import subprocess

    lineage = PostgresLineageStore(dsn)
    shape = AgenticShape(
        rollouts=1, calls=2, first_prompt_tokens=30, new_tokens_per_turn=5, generated_tokens=4
    )
    data = conversation_rollouts(shape)
    entry = data.rollouts[0][0]
    assert lineage.resolve_now(entry.rollout_id, data.continuations[0][0]).status is not (
        ParentResolutionStatus.RESOLVED
    )
    stamped = stamp_continuation(entry, data.requests[0][0])
    code = (
        "import sys\n"
        "from tokencapture.postgres import PostgresTokenCaptureStore\n"
        "from tokencapture.records import TokenEntry\n"
        "s = PostgresTokenCaptureStore(sys.argv[1])\n"
        "s.append(TokenEntry.model_validate_json(sys.stdin.read()))\n"
        "s.close_sync()\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, dsn], input=stamped.model_dump_json(), text=True, check=True
    )
    answer = lineage.resolve_now(entry.rollout_id, data.continuations[0][0])
    assert answer.match is not None and answer.match.model_call_id == entry.model_call_id
    lineage.close_sync()


def test_lineage_conformance(dsn: str) -> None:
    async def run() -> list[str]:
        return await run_conformance(
            lambda: PostgresTokenCaptureStore(dsn),
            lambda: PostgresTokenCaptureStore(dsn),
            lambda: PostgresLineageStore(dsn),
        )

    assert asyncio.run(run()) == STORE_CHECKS + LINEAGE_CHECKS


def test_bad_arguments_are_refused_when_called(dsn: str) -> None:
    lineage = PostgresLineageStore(dsn)
    with pytest.raises(ValueError):
        lineage.resolve("bad id", [])
    with pytest.raises(TypeError):
        lineage.resolve("r1", "not a list")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PostgresLineageStore(dsn, max_cached_rollouts=0)
    lineage.close_sync()


def test_nemo_gym_style_loading_gives_endpoints_of_its_protocols(dsn: str) -> None:
    """NeMo Gym 0.7.0 loads `module:Class` with its kwargs and checks the endpoint against its
    own protocols (its loader needs Python 3.12, so its steps are replayed here)."""
    import importlib
    import typing

    from tests.nemo_oracle import import_nemo

    protocols = import_nemo("protocols")
    for target, protocol in (
        ("tokencapture:PostgresTokenCaptureStore", protocols.TokenSink),
        ("tokencapture:PostgresTokenCaptureStore", protocols.TokenSource),
        ("tokencapture:PostgresLineageStore", protocols.LineageResolver),
    ):
        module_path, _, class_name = target.partition(":")
        endpoint = getattr(importlib.import_module(module_path), class_name)(**{"dsn": dsn})
        attrs = typing._get_protocol_attrs(protocol)  # type: ignore[attr-defined]
        assert attrs and all(callable(getattr(endpoint, name, None)) for name in attrs)
        assert isinstance(endpoint, protocol)
        endpoint.close_sync()
