"""Columnar snapshots: a rollout's entries as Arrow data, for trainers.

`TokenCaptureStore.freeze_columns(rollout_id)` (and `freeze_columns_now`) freezes a rollout
exactly as `freeze` does (the same fence, digest checks, folded tail, incomplete rule, snapshot
id and version) but decodes the verified log lines natively into Arrow buffers instead of
`TokenEntry` objects: no Python object per token. The result is a `ColumnarSnapshot`, which
implements the Arrow PyCapsule interface (`__arrow_c_stream__`), so any Arrow consumer reads it
without a copy::

    snapshot = store.freeze_columns_now("rollout-1")
    table = pyarrow.table(snapshot)             # or polars.from_arrow / duckdb
    ids = table["prompt_token_ids"].combine_chunks().values.to_numpy()  # int64, no copy

This package depends on no Arrow library; the consumer brings its own. `COLUMNS` lists the
schema, which is the same for every rollout (see docs/columnar.md).

`shared_prefixes=True` (on `freeze_columns`, `freeze_columns_now` and `read_columns`) makes
`prompt_token_ids` a `list_view<int64>` instead: a prompt that begins with the whole previous
prompt points at that prompt's ids and only its new suffix is stored, so an agentic chain's
prompts take one buffer; the ids read are the same (entry i is
`values[offsets[i]:offsets[i] + sizes[i]]`; pyarrow >= 16 reads list views).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokencapture import _core
from tokencapture.protocols import TokenCaptureCorruptionError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "COLUMNS",
    "ColumnarArray",
    "ColumnarEntries",
    "ColumnarSnapshot",
    "columns_of_lines",
]

ColumnarEntries = _core.ColumnarEntries
ColumnarArray = _core.ColumnarArray

#: The columns of every columnar snapshot, in order, with their Arrow types. Token ids are
#: int64 and log-probs float64; `routed_experts`, `output_items` and `extras` (the fields
#: `TokenEntry` does not declare, as one object; null when there are none) are JSON text.
#: With `shared_prefixes=True`, `prompt_token_ids` is `list_view<int64>`.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("schema_version", "int64"),
    ("rollout_id", "utf8"),
    ("model_call_id", "utf8"),
    ("model", "utf8"),
    ("prompt_token_ids", "list<int64>"),
    ("generation_token_ids", "list<int64>"),
    ("generation_log_probs", "list<float64>"),
    ("routed_experts", "utf8 (JSON text, null for None)"),
    ("output_items", "utf8 (JSON text)"),
    ("token_item_index", "int64 (nullable)"),
    ("response_id", "utf8 (nullable)"),
    ("created_at", "float64"),
    ("parent_call_id", "utf8 (nullable)"),
    ("cum_len", "int64 (nullable)"),
    ("digest", "utf8 (nullable)"),
    ("parent_resolution", "utf8 (nullable)"),
    ("continuation_fingerprint", "utf8"),
    ("continuation_context_len", "int64"),
    ("continuation_context_digest", "utf8"),
    ("parent_resolution_reason", "utf8"),
    ("fingerprint_version", "int64 (nullable)"),
    ("prompt_is_delta", "bool"),
    ("prefix_requested", "bool"),
    ("prefix_supplied", "bool"),
    ("extras", "utf8 (JSON object text, nullable)"),
)


@dataclass(frozen=True, slots=True)
class ColumnarSnapshot:
    """One rollout's frozen entries as Arrow data: one row per entry, in commit order.

    `entries` is a record batch object (`__arrow_c_array__`); the snapshot itself is an Arrow
    stream of that one batch (`__arrow_c_stream__`). The buffers are shared with every
    consumer that imports them and freed when the last one lets go.

    A snapshot pickles (for a data loader's worker processes): `entries` as its batch written
    as an Arrow IPC stream, the same buffers copied once (see docs/columnar.md, "Pickling").
    """

    rollout_id: str
    entries: _core.ColumnarEntries
    incomplete: bool
    snapshot_id: str
    version: int

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def num_rows(self) -> int:
        return self.entries.num_rows

    def __arrow_c_stream__(self, requested_schema: object | None = None) -> object:
        """The entries as an Arrow C stream capsule (the schema is fixed: a requested one is
        ignored, as the interface allows)."""
        return self.entries.__arrow_c_stream__(requested_schema)

    def __arrow_c_schema__(self) -> object:
        return self.entries.__arrow_c_schema__()

    def cumulative_tokens(self) -> _core.ColumnarArray:
        """Per entry, the token sequence a trainer feeds the model after that call: prompt then
        generation, a delta-encoded entry's prompt preceded by its parent's sequence (through
        the chain of parents in this snapshot). One `list<int64>` Arrow array (one flat buffer
        with offsets; `pyarrow.array(...)` imports it). `ValueError` if a delta entry's chain
        breaks (a parent missing from the snapshot, or a cycle)."""
        return self.entries.cumulative_tokens()


def columns_of_lines(lines: Sequence[bytes]) -> _core.ColumnarEntries:
    """Canonical lines that are all records, stored apart and already checked against their
    payload digests by the caller, as columns. A line that is not a valid entry raises
    `ValueError` naming its index. (The PostgreSQL store decodes its fetched lines with
    `_core.columns_of_log`, which checks the digests itself.)"""
    try:
        return _core.columns_of_lines(lines)
    except _core.ColumnarRecordError as exc:
        index, message = exc.args
        raise ValueError(f"line {index} is not a valid entry: {message}") from None


def columnar_refusal(
    exc: _core.ColumnarRecordError, path: object, object_read: Callable[[], object]
) -> Exception:
    """What to raise for a record the columnar decoder refused.

    Freeze's refusal of the same record, worded as freeze words it: `object_read` runs the
    object path (freeze or read_entries) and raises it. A record freeze accepts but the columns
    cannot hold (an int beyond int64) gets a plain `ValueError`.
    """
    offset, message = exc.args
    try:
        object_read()
    except TokenCaptureCorruptionError as refused:
        return refused
    return ValueError(
        f"{path}: the entry at byte offset {offset} cannot be read as columns: {message}"
    )
