"""Print the hostile-input table (markdown) for the README: input -> exception -> message.

    python -m tests.reliability.hostile_table [--store rust|reference|both]

Each case of `tests/reliability/hostile.py` runs against a fresh store in a temporary
directory; the table shows what the store did: the exception type and the start of its
message, or what an accepted input turned into.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from tests.reliability.common import listing, open_store, reference_available
from tests.reliability.hostile import CASES, ROLLOUT, Case, make_seed_entry

EXCERPT = 110


def excerpt(text: str) -> str:
    """The message on one line; a long one keeps its start and its end (the cause is often
    at the end)."""
    # pydantic's messages end each error with a docs link and a `[type=..., input_value=...]`
    # echo of the input: noise in a table.
    lines = [line for line in text.splitlines() if "errors.pydantic.dev" not in line]
    flat = re.sub(r"\s*\[type=.*?input_type=\w+\]", "", " ".join(" ".join(lines).split()))
    if len(flat) > EXCERPT:
        flat = flat[: EXCERPT // 2] + " … " + flat[-(EXCERPT // 2) :]
    return flat.replace("|", "\\|").replace("`", "'")


def outcome(kind: str, case: Case) -> str:
    with tempfile.TemporaryDirectory(prefix="tokencapture-hostile-") as directory:
        root = Path(directory) / "store"
        open_store(kind, root).append(make_seed_entry())
        store = open_store(kind, root)
        before = listing(root)
        try:
            case.call(store)
        except Exception as exc:
            unchanged = "" if listing(root) == before else " **(files changed!)**"
            return f"`{type(exc).__name__}`: {excerpt(str(exc))}{unchanged}"
        if case.marks:
            return (
                "accepted: rollout marked incomplete"
                if store.is_incomplete(ROLLOUT)
                else ("accepted, **not marked**")
            )
        expected = case.expected_entry()
        rollout_id = expected.rollout_id if expected is not None else ROLLOUT
        try:
            open_store(kind, root).freeze_now(rollout_id)
        except Exception as exc:
            return f"accepted, **then unreadable**: `{type(exc).__name__}`"
        return "accepted; reads back byte-identical"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default="both", choices=["rust", "reference", "both"])
    args = parser.parse_args(argv)
    kinds = ["rust", "reference"] if args.store == "both" else [args.store]
    if "reference" in kinds and not reference_available():
        kinds.remove("reference")
    header = "| input | call | " + " | ".join(f"{k} store" for k in kinds) + " |"
    print(header)
    print("|" + " --- |" * (2 + len(kinds)))
    for case in CASES:
        cells = [outcome(kind, case) for kind in kinds]
        print(f"| {case.input} | `{case.op}` | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
