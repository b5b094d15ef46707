"""Argument checks every backend and surface shares (a neutral module below all of them).

What a rollout id, a batch of them, a call id, a snapshot id, a failure row's fields, a resolve
request and the resolver cache bounds must be. Each check raises `TypeError` for a value of the
wrong type and `ValueError` for a bad value, before anything changes, and returns the checked
value (a batch deduplicated, request items as a list). The file store, the PostgreSQL backend,
the lineage resolvers, the capture ledgers and the reference twin all call these, so one misuse
is refused with the same words everywhere. See docs/architecture.md for the layer map.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from tokencapture import _core

__all__ = [
    "LINE_SPACE",
    "check_age",
    "check_cache_limits",
    "check_call_id",
    "check_failure_args",
    "check_resolve_args",
    "check_snapshot_id",
    "request_list",
    "validate_rollout_id",
    "validate_rollout_ids",
    "validated_batch",
]

LINE_SPACE: Final[str] = " \t\n\x0b\x0c\r"
"""What readers strip from both ends of an intents line (`bytes.strip()`, as NeMo Gym reads
them)."""


def validate_rollout_id(rollout_id: str) -> str:
    """Reject anything that could escape the store directory or index a bad file."""
    if not isinstance(rollout_id, str):
        raise TypeError(f"rollout_id must be a str, not {type(rollout_id).__name__}")
    _core.validate_rollout_id(rollout_id)
    return rollout_id


def validate_rollout_ids(rollout_ids: Sequence[str]) -> list[str]:
    """Validate a whole batch before anything changes, and drop duplicates (first order kept).

    A bare string is rejected (`TypeError`): it is a sequence of one-character rollout ids, and
    NeMo Gym 0.7.0's synchronous `delete(rollout_id)` would otherwise silently do nothing.
    """
    return validated_batch(rollout_ids, validate_rollout_id)


def validated_batch(rollout_ids: Sequence[str], validate_one: Callable[[str], str]) -> list[str]:
    """`validate_rollout_ids` with the check of one id given (the reference store's is Python)."""
    if isinstance(rollout_ids, str | bytes):
        raise TypeError(
            f"rollout_ids must be a sequence of rollout ids, not a single string "
            f"({rollout_ids!r}); pass [{rollout_ids!r}]. NeMo Gym 0.7.0's synchronous "
            "store.delete(rollout_id) is store.delete_now([rollout_id]) here"
        )
    if not isinstance(rollout_ids, Iterable):
        raise TypeError(
            f"rollout_ids must be a sequence of rollout ids, not {type(rollout_ids).__name__}"
        )
    return list(dict.fromkeys(validate_one(rollout_id) for rollout_id in rollout_ids))


def check_age(seconds: object, name: str = "older_than_seconds") -> float:
    """An age in seconds (`sweep_retired`'s cutoff): a real number (`TypeError` for anything
    else, `bool` included), not NaN and within a float's range (`ValueError`). Negative and
    infinite ages are allowed (a negative age reaches into the future)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError(f"{name} must be a number, not {type(seconds).__name__}")
    try:
        value = float(seconds)
    except OverflowError:
        raise ValueError(f"{name} is out of a float's range: {seconds}") from None
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    return value


def check_snapshot_id(snapshot_id: object) -> str:
    """A snapshot id is a str (`TypeError` otherwise)."""
    if not isinstance(snapshot_id, str):
        raise TypeError(f"snapshot_id must be a str, not {type(snapshot_id).__name__}")
    return snapshot_id


def check_flag(value: object, name: str) -> bool:
    """A keyword flag: a real bool (a truthy string or number is a caller's mistake), or
    numpy's bool, which the native calls take as one too."""
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)
    where = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
    raise TypeError(f"{name} must be a bool, not {where}{kind.__qualname__}")


def check_call_id(call_id: object) -> str:
    """A call id must be one line of the intents file: non-empty, no line break, UTF-8, and
    without the surrounding whitespace readers strip (`TypeError` / `ValueError`)."""
    if (
        type(call_id) is str
        and call_id.isascii()
        and call_id.isprintable()  # printable ASCII: no line break, tab or surrogate
        and call_id[:1] != " "
        and call_id[-1:] != " "
        and call_id
    ):
        return call_id
    if not isinstance(call_id, str):
        raise TypeError(f"model_call_id must be a str, not {type(call_id).__name__}")
    if not call_id:
        raise ValueError("model_call_id must not be empty")
    if "\n" in call_id or "\r" in call_id:
        raise ValueError(f"model_call_id {call_id!r} contains a line break")
    if call_id != call_id.strip(LINE_SPACE):
        raise ValueError(
            f"model_call_id {call_id!r} starts or ends with whitespace, which readers of the "
            "intents file strip: its intent would not match its entry"
        )
    try:
        call_id.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("model_call_id must be valid Unicode text (no lone surrogates)") from None
    return call_id


def check_failure_args(rollout_id: str, model_call_id: str, reason: str) -> None:
    """The checks of a capture ledger's `record_failure`: a valid rollout id, and a call id and
    reason that are non-empty `str`s encodable as UTF-8 (`TypeError` / `ValueError`)."""
    validate_rollout_id(rollout_id)
    for name, value in (("model_call_id", model_call_id), ("reason", reason)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, not {type(value).__name__}")
        if not value:
            raise ValueError(f"{name} must not be empty")
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            raise ValueError(f"{name} is not valid Unicode (a lone surrogate): {exc}") from exc


def request_list(request_items: Iterable[Any]) -> list[Any]:
    """The request items as a list (a list is used as is, any other iterable copied).

    A falsy value (``None``, ``""``, ``{}``, ``0``, ...) is no items, as NeMo Gym 0.7.0's
    resolvers read it (``messages or []``): such a request is a root. A non-empty `str`,
    `bytes` or mapping is refused with `TypeError`: each is iterable, but iterating it yields
    characters or keys, never request items.
    """
    if isinstance(request_items, list):
        return request_items
    if request_items is None or (
        isinstance(request_items, str | bytes | bytearray | Mapping | int | float)
        and not request_items
    ):
        return []
    if isinstance(request_items, str | bytes | bytearray | Mapping) or not isinstance(
        request_items, Iterable
    ):
        raise TypeError(
            f"request_items must be a list of request items, not {type(request_items).__name__}"
        )
    return list(request_items)


def check_resolve_args(rollout_id: str, request_items: Iterable[Any]) -> list[Any]:
    """The checks of `resolve`'s arguments: a valid rollout id and a list of request items
    (`TypeError` / `ValueError`); returns the items as `request_list` does. An item that is
    not a dict is the `ValueError` the fingerprint would raise when awaited, raised here."""
    validate_rollout_id(rollout_id)
    items = request_list(request_items)
    for item in items:
        if not isinstance(item, dict):
            raise ValueError(f"a message item must be a dict, not {type(item).__name__}")
    return items


def check_cache_limits(max_cached_rollouts: int, max_cached_tokens: int) -> None:
    """The cache bounds every durable-log resolver takes (file and PostgreSQL)."""
    if max_cached_rollouts < 1:
        raise ValueError("max_cached_rollouts must be at least 1")
    if max_cached_tokens < 0:
        raise ValueError("max_cached_tokens must not be negative")
