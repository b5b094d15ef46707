"""Hostile inputs: each is refused with a clear ValueError/TypeError and nothing written, or
accepted and read back exactly; `mark_incomplete` takes any call id and still marks.

The cases and their expectations live in `tests/reliability/hostile.py`; the README table is
generated from the same cases by `python -m tests.reliability.hostile_table`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tests.reliability.common import (
    REFERENCE_MISSING_REASON,
    listing,
    open_store,
    reference_available,
)
from tests.reliability.hostile import (
    ACCEPTED,
    CASES,
    EITHER,
    REFUSED,
    ROLLOUT,
    Case,
    make_seed_entry,
)

from tokencapture.store import canonical_line


def params() -> list[object]:
    out: list[object] = []
    for case in CASES:
        for kind in ("rust", "reference"):
            marks = []
            if kind == "reference" and not reference_available():
                marks.append(pytest.mark.skip(reason=REFERENCE_MISSING_REASON))
            if kind in case.bugs:
                marks.append(pytest.mark.xfail(strict=True, reason=case.bugs[kind]))
            out.append(pytest.param(kind, case, id=f"{kind}-{case.id}", marks=marks))
    return out


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per store kind, a directory where ROLLOUT holds one entry (copied for each case)."""
    out: dict[str, Path] = {}
    for kind in ("rust", "reference"):
        if kind == "reference" and not reference_available():
            continue
        root = tmp_path_factory.mktemp(f"seed-{kind}") / "store"
        open_store(kind, root).append(make_seed_entry())
        out[kind] = root
    return out


@pytest.mark.parametrize(("kind", "case"), params())
def test_hostile_input(kind: str, case: Case, tmp_path: Path, seeded: dict[str, Path]) -> None:
    root = tmp_path / "store"
    shutil.copytree(seeded[kind], root)
    seed = make_seed_entry()
    store = open_store(kind, root)
    before = listing(root)
    error: ValueError | TypeError | None = None
    try:
        case.call(store)
    except (ValueError, TypeError) as exc:
        error = exc
    if error is not None:
        assert case.expect in (REFUSED, EITHER), f"refused: {type(error).__name__}: {error}"
        message = str(error).lower()
        for word in case.words:
            assert word.lower() in message, f"{word!r} not in the message: {error}"
        assert listing(root) == before, "a refused call wrote something"
        return
    assert case.expect in (ACCEPTED, EITHER), "accepted, but it must be refused"
    reader = open_store(kind, root)
    expected = case.expected_entry()
    if expected is not None:
        if len(expected.prompt_token_ids) < 100_000:  # the huge one: freeze alone is enough
            stored = reader.read_entries(expected.rollout_id)
            assert canonical_line(stored[-1]) == canonical_line(expected)
        frozen = reader.freeze_now(expected.rollout_id)
        assert canonical_line(frozen.entries[-1]) == canonical_line(expected)
    if case.marks:
        assert reader.is_incomplete(ROLLOUT)
        assert reader.freeze_now(ROLLOUT).incomplete
    # The seed entry is untouched either way.
    assert canonical_line(reader.read_entries(ROLLOUT)[0]) == canonical_line(seed)
