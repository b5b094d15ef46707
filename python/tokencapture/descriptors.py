"""The process-wide descriptor budget, as the file store, resolver and ledger report it.

Every cache of descriptors in the native core (the token store's per-rollout lock, log and
state files, the resolver's and the ledger's logs, the staging store's segment and store
lock) counts against one budget per process: a
sixteenth of the soft `RLIMIT_NOFILE` (at least 16, at most 4096, never more than a quarter
of the limit), or `TOKENCAPTURE_MAX_OPEN_FILES` when set. A store's `max_open_files=` caps
what that store keeps on top. When an open fails with `EMFILE` or `ENFILE`, every cache of
the process is closed and the open is retried once; see docs/reliability.md.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from typing import Any, Protocol

from tokencapture import _core

__all__ = ["budget", "check_max_open_files", "close_cached", "descriptor_stats", "set_budget"]

ENV_VAR = "TOKENCAPTURE_MAX_OPEN_FILES"


def _warn_if_env_is_not_a_count() -> None:
    """The core ignores a `TOKENCAPTURE_MAX_OPEN_FILES` that is not a count (it keeps the
    default share of the soft limit): say so once, at import, rather than silently."""
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return
    text = raw.strip()
    if re.fullmatch(r"\+?[0-9]+", text) and int(text) < 2**64:
        return
    warnings.warn(
        f"{ENV_VAR}={raw!r} is not a non-negative integer and is ignored: the descriptor "
        "budget is the default share of the soft RLIMIT_NOFILE",
        RuntimeWarning,
        stacklevel=2,
    )


_warn_if_env_is_not_a_count()


def check_max_open_files(max_open_files: int | None) -> int | None:
    """Refuse a `max_open_files=` that is not None or a non-negative int; the value to pass
    to the core (a cap past what the core counts in is no cap: it becomes `sys.maxsize`)."""
    if max_open_files is None:
        return None
    if isinstance(max_open_files, bool) or not isinstance(max_open_files, int):
        raise TypeError("max_open_files must be an int or None")
    if max_open_files < 0:
        raise ValueError("max_open_files must not be negative")
    return min(max_open_files, sys.maxsize)


class _HoldsDescriptors(Protocol):
    def open_files(self) -> int: ...
    def max_open_files(self) -> int | None: ...


def budget() -> dict[str, int]:
    """The process's budget: `limit`, `held` (descriptors kept by every cache now),
    `exhausted` (opens that ran out of descriptors, `EMFILE`/`ENFILE`, and closed every cache
    before retrying once), `failed` (of those, the retries that ran out again and raised) and
    `evicted` (idle cache entries closed, each keeping up to three descriptors: to stay within
    a cap or the budget, or emptied after an exhausted open; entries, not descriptors)."""
    return _core.descriptor_budget()


def set_budget(limit: int | None) -> None:
    """Fix the process's budget (None: back to the share of the soft limit); the caches close
    what is over it at once."""
    _core.set_descriptor_budget(check_max_open_files(limit))


def close_cached() -> int:
    """Close every idle descriptor tokencapture's caches keep in this process; how many.

    What every open of the stores does when it runs out of descriptors (`EMFILE`/`ENFILE`),
    before its one retry: a server whose own open ran out (a socket it accepts or connects)
    calls it before retrying that open once. The caches fill again as they are used."""
    return _core.close_cached_descriptors()


def descriptor_stats(native: _HoldsDescriptors) -> dict[str, Any]:
    """What a native store, resolver or ledger keeps open (`open_files`), its own cap
    (`max_open_files`, None without one), and the process budget's counters prefixed with
    `process_` (see `budget`)."""
    stats: dict[str, Any] = {
        "open_files": native.open_files(),
        "max_open_files": native.max_open_files(),
    }
    stats.update({f"process_{key}": value for key, value in budget().items()})
    return stats
