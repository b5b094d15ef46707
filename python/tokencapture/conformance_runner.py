"""What both conformance suites share (`tokencapture.conformance` for the token store, lineage
and ledger; `tokencapture.conformance_staging` for staging): the results list, the skip,
closing clients whatever they raise, binding a directory to a factory, and running a job in a
spawned process with a picklable factory."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "NO_PROCESS_FACTORY",
    "ConformanceResults",
    "Outcome",
    "SkipCheck",
    "bind_directory",
    "close_sync",
    "describe_error",
    "receive",
    "spawned",
    "with_close_errors",
]

_T = TypeVar("_T")


class SkipCheck(Exception):
    """The check needs a capability the implementation does not have."""


@dataclass(frozen=True)
class Outcome:
    """One check's outcome: "pass", "skip" (`detail` says why) or "fail" (`error`, the
    suite's own `AssertionError`, to raise)."""

    check: str
    status: str
    detail: str = ""
    error: AssertionError | None = None


class ConformanceResults(list[str]):
    """The names of the checks that passed, in order (a plain ``list[str]`` to compare), plus
    `skipped`: each check that did not apply, mapped to the reason."""

    def __init__(
        self, passed: Iterable[str] = (), skipped: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(passed)
        self.skipped: dict[str, str] = dict(skipped or {})


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _wait_sync(awaitable: Awaitable[Any]) -> Any:
    """Await `awaitable` from synchronous code, even when a loop is running in this thread
    (then on a private loop in a helper thread), so an ``async def close`` is really run."""

    async def wait() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    outcome: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(asyncio.run(wait()))
        except BaseException as exc:  # handed back to the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="conformance-close")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return outcome[0]


def close_sync(clients: list[Any]) -> list[BaseException]:
    """Close every distinct client (newest first) that has a ``close``; the errors raised."""
    errors: list[BaseException] = []
    seen: set[int] = set()
    for client in reversed(clients):
        if id(client) in seen:
            continue
        seen.add(id(client))
        close = getattr(client, "close", None)
        if not callable(close):
            continue
        try:
            result = close()
            if inspect.isawaitable(result):
                _wait_sync(result)
        except Exception as exc:  # one failing close must not leave the others open
            errors.append(exc)
    clients.clear()
    return errors


_E = TypeVar("_E", bound=AssertionError)


def with_close_errors(
    error: _E | None, close_errors: list[BaseException], make: Callable[[str], _E]
) -> _E | None:
    """Fold the errors of closing clients into the check's outcome: the failure itself when
    there was none (caused by the first close error), else a note on the earlier failure,
    which stays the one reported."""
    if not close_errors:
        return error
    detail = "; ".join(f"close() raised {describe_error(exc)}" for exc in close_errors)
    if error is None:
        error = make(detail)
        error.__cause__ = close_errors[0]
    else:
        error.add_note(f"while cleaning up, {detail}")
    return error


def bind_directory(factory: Callable[..., _T], directory: str) -> Callable[[], _T]:
    """A zero-argument factory: `factory` itself, or `factory(directory)` if it needs one."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return factory
    required = [
        parameter
        for parameter in signature.parameters.values()
        if parameter.default is inspect.Parameter.empty
        and parameter.kind
        in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if not required:
        return factory
    if len(required) == 1:
        return functools.partial(factory, directory)
    names = ", ".join(parameter.name for parameter in required)
    raise TypeError(
        f"factory {getattr(factory, '__qualname__', factory)!r} must take no argument or one "
        f"directory, but requires ({names})"
    )


NO_PROCESS_FACTORY = (
    "no process_factory was given: pass a picklable one (a module-level class or function, "
    "or a functools.partial of one) to check what other processes see"
)
_CHILD_TIMEOUT = 120.0


def _child_main(
    target: Callable[..., None], factory: Callable[[], Any], args: Any, conn: Any
) -> None:
    """Run `target(factory, args, conn)` in the spawned child; its failure goes to the parent
    as text (an exception need not pickle), so the parent can name it."""
    try:
        target(factory, args, conn)
    except BaseException as exc:
        conn.send(("error", describe_error(exc)))
        raise


@contextlib.contextmanager
def spawned(
    process_factory: Callable[[], Any] | None,
    target: Callable[..., None],
    args: Any,
    error: Callable[[str], AssertionError],
) -> Iterator[Any]:
    """Run `target` in a spawned process with `process_factory`; yield the parent's end of a
    pipe the child answers on (read it with `receive`). A spawned child imports the parent's
    main module again, hence the ``if __name__ == "__main__":`` guard scripts need."""
    import multiprocessing
    import pickle

    if process_factory is None:
        raise SkipCheck(NO_PROCESS_FACTORY)
    try:
        pickle.dumps(process_factory)
    except Exception as exc:
        raise error(
            "process_factory must be picklable, as it is called in a spawned process: use a "
            "module-level class or function, or a functools.partial of one (not a lambda or a "
            f"local function); pickling it raised {describe_error(exc)}"
        ) from exc
    spawn = multiprocessing.get_context("spawn")
    parent, child = spawn.Pipe(duplex=False)
    process = spawn.Process(target=_child_main, args=(target, process_factory, args, child))
    process.start()
    child.close()
    try:
        yield parent
    finally:
        process.join(_CHILD_TIMEOUT)
        if process.is_alive():
            process.kill()
            process.join()
        parent.close()


def receive(conn: Any, what: str, error: Callable[[str], AssertionError]) -> Any:
    """The child's next answer; its failure (in the factory or the job) as `error`. Raises
    EOFError once the child is gone."""
    if not conn.poll(_CHILD_TIMEOUT):
        raise error(f"{what}: the child process sent nothing within {_CHILD_TIMEOUT:.0f}s")
    tag, value = conn.recv()
    if tag == "error":
        raise error(f"{what}: the child process (its process_factory or the job) raised {value}")
    return value
