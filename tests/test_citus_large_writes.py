"""On Citus a write's timeout allows for its size too (`statement_timeout_for`): a put of a
64 MiB line took ~5 s delegated on the test cluster (255 MiB: 26 s, past the default 30 s on a
loaded machine), so a 1 s timeout cut it off. A write over 1 MiB now runs in a transaction
of its own with the allowance (`Client.call`): on the coordinator, not delegated (~3.5 s for
64 MiB, 13 s for 255 MiB)."""

from __future__ import annotations

import os

from tests.citus_fixture import citus_cluster, citus_db, citus_dsn
from tests.conftest import make_entry
from tests.staging_backends import make_record

from tokencapture.postgres import PostgresStagingStore, PostgresTokenCaptureStore

__all__ = ["citus_cluster", "citus_db", "citus_dsn"]  # the fixtures, imported for pytest

MiB = 1 << 20
SHORT = 1.0  # under the ~3.5-5 s a 64 MiB put takes there; the allowance for it is 16 s


def test_a_large_first_put_and_a_large_stage_succeed_on_citus_under_a_short_timeout(
    citus_dsn: str,
) -> None:
    """A store's first put (it does not know yet it is on Citus: its connection tells it, and
    the line is checked against the Citus limit there) of a 64 MiB line, then a stage with 64
    MiB of attachments, each under a 1 s timeout; read back under the default timeout (a
    read's timeout does not allow for what it fetches)."""
    import base64

    line = base64.b64encode(os.urandom(48 * MiB)).decode()  # 64 MiB, incompressible
    entry = make_entry("big", blob=line)
    del line
    store = PostgresTokenCaptureStore(citus_dsn, statement_timeout=SHORT)
    reader = PostgresTokenCaptureStore(citus_dsn)
    try:
        store.append(entry)
        assert store._client.distributed is True
        assert store._client.run_sync(store.put_unless_stored(entry)) is False  # stored
        store.append(make_entry("big", call=2))  # small, delegated: the session as it was
        assert reader.read_entries("big") == [entry, make_entry("big", call=2)]
    finally:
        store.close_sync()
        reader.close_sync()
    del entry

    staging = PostgresStagingStore(citus_dsn, statement_timeout=SHORT)
    staging_reader = PostgresStagingStore(citus_dsn)
    try:
        blob = os.urandom(64 * MiB)
        record = make_record("s", "big")
        result = staging.stage(record, attachments={"blob": blob})
        assert result.ok, result
        assert staging_reader.fetch_attachments(record.staging_key)["blob"].data == blob
    finally:
        staging.close()
        staging_reader.close()
