"""Python locks that a forked child replaces (a neutral leaf module of the core layer).

A child made by `fork()` has only the thread that forked. A `threading.Lock` that another
thread held at that moment is copied held, and nothing in the child ever releases it: the
child's first call that takes it waits forever. The native core renews its own state per
process (`rust/src/fork.rs`); this does the same for the few Python locks the package keeps
(metrics, OpenTelemetry recorders, the lazily made thread pool and capture ledger), so a
child forked while other threads were working can use the same objects. The state those
locks guard is kept: a counter a parent's thread was updating at the fork may be off by that
one update in the child, which is acceptable for what they guard (counts, a lazy singleton).

`leak` is the other half, for what a child must not use and must not release either: the
parent's event loops, their connections and threads (the PostgreSQL classes). A child's copy
of an event loop shares the parent's epoll instance, and closing or collecting a connection of
it unregisters the parent's socket from that instance (or says goodbye on the parent's
session): the parent's calls on that connection would then wait forever. The native core
leaks the parent's objects in a child the same way (`rust/src/fork.rs`).

A child also gives up, first thing, its copies of the parent's lock file descriptors: an
flock belongs to the open file description a copy shares, so a parent that died holding a
rollout's lock (SIGKILL mid-put) would otherwise leave it held for as long as the child lived.
Each is replaced by `/dev/null` rather than closed, so its number is never reused under the
parent's leaked objects (`rust/src/lock.rs`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import weakref
from collections.abc import Callable

from tokencapture import _core

__all__ = ["ProcessOwner", "leak", "renew_after_fork"]

# owner -> the names of its attributes that hold a lock to renew.
_owners: weakref.WeakKeyDictionary[object, tuple[str, ...]] = weakref.WeakKeyDictionary()


def renew_after_fork(owner: object, *attributes: str) -> None:
    """In a forked child, give `owner` a fresh `threading.Lock` in each of `attributes`.

    `owner` is held weakly (a module, or an object that can be weakly referenced); calling
    again for the same owner replaces its list.
    """
    _owners[owner] = attributes


def leak(*objects: object) -> None:
    """Keep `objects` (and all they hold) alive, unused, for the rest of this process.

    For a forked child's copies of its parent's objects: one reference more that nothing ever
    releases, so neither the collector nor the interpreter's exit (which clears the modules a
    plain list would live in) ever runs their finalizers here.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(objects))


class ProcessOwner:
    """The process an object's state belongs to, and its one start-over in a forked child.

    An object whose state a child must not use (the parent's loops, sessions, indexes) calls
    `start_over_in_child` first thing in each entry point: in the process that made it, one
    pid compare; in a child, the first call runs `start_over` (which leaks the parent's state
    and makes fresh state) under `lock`, once, however many threads arrive together.
    """

    __slots__ = ("_pid",)

    def __init__(self) -> None:
        self._pid = os.getpid()

    def is_current(self) -> bool:
        """Whether the state belongs to this process (made here, or started over here)."""
        return self._pid == os.getpid()

    def start_over_in_child(self, lock: threading.Lock, start_over: Callable[[], None]) -> None:
        """Run `start_over` if this process is not the owner yet; `lock` must be one that
        `renew_after_fork` renews (a parent's thread may have held it at the fork)."""
        if self._pid == os.getpid():
            return
        with lock:
            if self._pid == os.getpid():
                return
            start_over()
            self._pid = os.getpid()


def _renew_in_child() -> None:
    _release_inherited_locks()
    for owner, attributes in list(_owners.items()):
        for name in attributes:
            setattr(owner, name, threading.Lock())


def _release_inherited_locks() -> None:
    """Put `/dev/null` in place of every lock file descriptor the parent had open."""
    inherited = _core.take_inherited_lock_files()
    if not inherited:
        return
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in inherited:
            with contextlib.suppress(OSError):  # a failed swap leaves what was there
                os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


os.register_at_fork(after_in_child=_renew_in_child)
