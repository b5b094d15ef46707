"""The staging backends the same behavioural tests run on (the file store and the PostgreSQL
store, through asyncpg and through the native group commit), as a pytest fixture. Apart from
`tests.staging_backends`, which the servers' account imports without pytest."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tokencapture import FileStagingStore
from tokencapture.postgres import PostgresStagingStore

__all__ = ["Store", "staging_backend"]

Store = FileStagingStore | PostgresStagingStore


@pytest.fixture(name="staging", params=["file", "postgres", "postgres-native"])
def staging_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """Each backend in turn (the PostgreSQL one on a fresh database, its stages through
    asyncpg and through the native group commit). A module using it imports the `dsn`
    fixture too (`tests.postgres_fixture`); a test takes it as `staging`."""
    if request.param == "file":
        yield FileStagingStore(tmp_path / "staging")
        return
    database = request.getfixturevalue("dsn")
    store = PostgresStagingStore(database, native_group_commit=request.param == "postgres-native")
    yield store
    if request.param == "postgres-native" and store.native_fallback_reason is None:
        # Whatever the test staged went through the native client.
        assert store._native is None or store._native.stats()[1] > 0 or not store.keys()
    store.close_sync()
