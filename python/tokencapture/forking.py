"""Python locks that a forked child replaces (a neutral leaf module of the core layer).

A child made by `fork()` has only the thread that forked. A `threading.Lock` that another
thread held at that moment is copied held, and nothing in the child ever releases it: the
child's first call that takes it waits forever. The native core renews its own state per
process (`rust/src/fork.rs`); this does the same for the few Python locks the package keeps
(metrics, OpenTelemetry recorders, the lazily made thread pool and capture ledger), so a
child forked while other threads were working can use the same objects. The state those
locks guard is kept: a counter a parent's thread was updating at the fork may be off by that
one update in the child, which is acceptable for what they guard (counts, a lazy singleton).
"""

from __future__ import annotations

import os
import threading
import weakref

__all__ = ["renew_after_fork"]

# owner -> the names of its attributes that hold a lock to renew.
_owners: weakref.WeakKeyDictionary[object, tuple[str, ...]] = weakref.WeakKeyDictionary()


def renew_after_fork(owner: object, *attributes: str) -> None:
    """In a forked child, give `owner` a fresh `threading.Lock` in each of `attributes`.

    `owner` is held weakly (a module, or an object that can be weakly referenced); calling
    again for the same owner replaces its list.
    """
    _owners[owner] = attributes


def _renew_in_child() -> None:
    for owner, attributes in list(_owners.items()):
        for name in attributes:
            setattr(owner, name, threading.Lock())


os.register_at_fork(after_in_child=_renew_in_child)
