"""Moving rollouts whole between a PostgreSQL database and a store directory, either way:
the database side of `tokencapture.transfer` (whose `RolloutImage` both sides share).
"""

from __future__ import annotations

from tokencapture import _core
from tokencapture.postgres._client import Client
from tokencapture.protocols import TokenCaptureCorruptionError
from tokencapture.store import validate_rollout_id
from tokencapture.transfer import (
    RolloutImage,
    export_from_directory,
    import_into_directory,
    rollouts_in_directory,
)

__all__ = [
    "RolloutImage",
    "export_from_directory",
    "export_from_postgres",
    "import_into_directory",
    "import_into_postgres",
    "rollouts_in_directory",
    "rollouts_in_postgres",
]


# PostgreSQL -------------------------------------------------------------------------------------


async def rollouts_in_postgres(client: Client) -> list[str]:
    rows = await client.fetch(
        "rows", "SELECT rollout_id FROM tokencapture.rollouts ORDER BY rollout_id"
    )
    return [row["rollout_id"] for row in rows]


async def export_from_postgres(client: Client, rollout_id: str) -> RolloutImage | None:
    validate_rollout_id(rollout_id)
    row = await client.fetch("row", "SELECT * FROM tokencapture.export_rollout($1)", rollout_id)
    if row["status"] != 0:
        return None
    return RolloutImage.with_state(
        rollout_id,
        row,
        entries=[
            (call_id.decode(), digest, line)
            for call_id, digest, line in zip(
                row["call_ids"], row["digests"], row["lines"], strict=True
            )
        ],
        intents=list(row["intents"]),
        markers=list(row["markers"]),
    )


async def import_into_postgres(client: Client, image: RolloutImage) -> bool:
    validate_rollout_id(image.rollout_id)
    for call_id, digest, line in image.entries:
        if _core.payload_digest(line) != digest:
            raise TokenCaptureCorruptionError(
                f"rollout {image.rollout_id!r}: the line of {call_id!r} does not match its digest"
            )
    return bool(
        await client.fetch(
            "val",
            "SELECT tokencapture.import_rollout($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
            image.rollout_id,
            image.frozen,
            image.retired,
            image.incomplete,
            image.snapshot_id,
            image.version,
            [call_id.encode() for call_id, _, _ in image.entries],
            [digest for _, digest, _ in image.entries],
            [line for _, _, line in image.entries],
            image.intents,
            image.markers,
            idempotent=False,  # a retry after a commit would report the rollout as existing
            sized=True,  # a whole rollout's lines: its timeout allows for their size
        )
    )
