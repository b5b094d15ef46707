"""Fetched logs to entries or columns, with the file store's own native decoder.

A freeze or read fetches a rollout's lines as rows (one `bytes` per line, in commit order) with
each line's stored payload digest; the lines go to the decoder as they are, never joined into one
buffer (a buffer of newline-terminated lines is accepted too; byte offsets are those of the lines
joined, either way). `_core.decode_lines` checks every line against its digest, walks it for its
call id and builds the records the file store's read path builds (the same walk that copies
repeated runs of token ids from earlier lists and keeps its containers out of the garbage
collector's way); `_core.columns_of_log` does the same into Arrow columns. Only building Python
objects holds the interpreter: the hashing and, for a large log, the walk run on native threads
meanwhile. A line holding a newline byte is corruption. Refusals are the file store's corruption
errors, worded as it words them, with the rollout and server in place of the log's path.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokencapture import _core
from tokencapture import columnar as _columnar
from tokencapture.entries import entries_from_records
from tokencapture.protocols import TokenCaptureCorruptionError
from tokencapture.records import TokenEntry

__all__ = ["FetchedLog", "decode_columns", "decode_entries"]


def _one_line_per_call(where: str, records: int, lines: int) -> None:
    if records != lines:
        raise TokenCaptureCorruptionError(f"{where}: two stored lines share a call id")


FetchedLog = bytes | Sequence[bytes]
"""A fetched log: its lines apart (without newlines), or one buffer of newline-terminated lines."""


def decode_entries(log: FetchedLog, digests: Sequence[str], where: str) -> tuple[TokenEntry, ...]:
    """The entries of a fetched log: every line checked against its stored payload digest, then
    decoded natively and built as the file store builds entries; a bad line (or a line holding a
    newline byte) is corruption."""
    records, offsets = _core.decode_lines(log, digests, where)
    _one_line_per_call(where, len(records), len(digests))
    return entries_from_records(records, offsets, where)


def decode_columns(
    log: FetchedLog, digests: Sequence[str], where: str, *, shared_prefixes: bool = False
) -> _core.ColumnarEntries:
    """`decode_entries` as Arrow columns: the same checks, and a record the columns refuse is
    refused with the words the object path uses for it (see `columnar.columnar_refusal`).
    `shared_prefixes` as for the file store's `freeze_columns_now`."""
    try:
        entries = _core.columns_of_log(log, digests, where, shared_prefixes)
    except _core.ColumnarRecordError as exc:
        raise _columnar.columnar_refusal(
            exc, where, lambda: decode_entries(log, digests, where)
        ) from None
    _one_line_per_call(where, len(entries), len(digests))
    return entries
