"""Async methods check their arguments when they are CALLED, not when they are awaited.

A call that is never awaited (NeMo Gym 0.7.0 calls `store.delete(rollout_id)` synchronously)
must not be a silent no-op: bad arguments raise at the call, and no coroutine is left behind to
be collected unawaited. The public async methods of every public class are found by
introspection (coroutine functions, or methods annotated to return a coroutine), so a new one
without a row in the bad-argument table below fails `test_every_async_method_is_covered`.
"""

from __future__ import annotations

import asyncio
import collections.abc
import gc
import inspect
import typing
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import make_entry
from tests.postgres_fixture import pg_dsn, pg_server  # noqa: F401 - fixtures

from tokencapture.fingerprint import assistant_fingerprint, conversation_digest
from tokencapture.ledger import FileCaptureLedger
from tokencapture.lineage import FileLineageStore, InMemoryLineageStore
from tokencapture.postgres import (
    PostgresCaptureLedger,
    PostgresLineageStore,
    PostgresTokenCaptureStore,
)
from tokencapture.reference.lineage import FileLineageStore as ReferenceLineageStore
from tokencapture.reference.store import TokenCaptureStore as ReferenceStore
from tokencapture.store import TokenCaptureStore

# Each factory takes the test's temporary directory and a callable that gives the DSN of a
# fresh database (a PostgreSQL class asks for it, and installs the schema on first use; the
# others never do, so they need no server).
FACTORIES: dict[str, Callable[[Path, Callable[[], str]], Any]] = {
    "TokenCaptureStore": lambda root, dsn: TokenCaptureStore(root / "store"),
    "reference.TokenCaptureStore": lambda root, dsn: ReferenceStore(root / "reference"),
    "FileLineageStore": lambda root, dsn: FileLineageStore(root / "store"),
    "reference.FileLineageStore": lambda root, dsn: ReferenceLineageStore(root / "store"),
    "InMemoryLineageStore": lambda root, dsn: InMemoryLineageStore(),
    "FileCaptureLedger": lambda root, dsn: FileCaptureLedger(root / "ledger"),
    "PostgresTokenCaptureStore": lambda root, dsn: PostgresTokenCaptureStore(
        dsn(), install_schema=True
    ),
    "PostgresLineageStore": lambda root, dsn: PostgresLineageStore(dsn(), install_schema=True),
    "PostgresCaptureLedger": lambda root, dsn: PostgresCaptureLedger(dsn(), install_schema=True),
}
CLASSES: dict[str, type] = {
    "TokenCaptureStore": TokenCaptureStore,
    "reference.TokenCaptureStore": ReferenceStore,
    "FileLineageStore": FileLineageStore,
    "reference.FileLineageStore": ReferenceLineageStore,
    "InMemoryLineageStore": InMemoryLineageStore,
    "FileCaptureLedger": FileCaptureLedger,
    "PostgresTokenCaptureStore": PostgresTokenCaptureStore,
    "PostgresLineageStore": PostgresLineageStore,
    "PostgresCaptureLedger": PostgresCaptureLedger,
}


def valid_commit() -> Any:
    from tests.test_ledger import make_commit

    return make_commit("c1", "r1")


# A valid value for each parameter name (called fresh for every use).
VALID: dict[str, Callable[[], Any]] = {
    "entry": lambda: make_entry("r1", 1),
    "rollout_id": lambda: "r1",
    "rollout_ids": lambda: ["r1"],
    "model_call_id": lambda: "call-1",
    "request_items": lambda: [{"role": "user", "content": "hi"}],
    "snapshot_id": lambda: "0" * 32,
    "version": lambda: 1,
    "commit": valid_commit,
    "reason": lambda: "capture failed",
    "shared_prefixes": lambda: True,
}

# Bad values per parameter name, with the error each must raise at the call.
BAD: dict[str, list[tuple[str, Callable[[], Any], type[Exception]]]] = {
    "entry": [
        ("a str", lambda: "not an entry", TypeError),
        ("an int", lambda: 5, TypeError),
        ("a bad rollout id", lambda: make_entry("bad id", 1), ValueError),
        ("an empty call id", lambda: make_entry("r1", ""), ValueError),
        (
            "broken invariants",
            lambda: make_entry("r1", 1).model_copy(update={"generation_log_probs": []}),
            ValueError,
        ),
    ],
    "rollout_id": [
        ("empty", lambda: "", ValueError),
        ("a path", lambda: "../escape", ValueError),
        ("an int", lambda: 5, TypeError),
        ("None", lambda: None, TypeError),
    ],
    "rollout_ids": [
        ("a bare str", lambda: "r1", TypeError),
        ("an int", lambda: 5, TypeError),
        ("a bad id in the batch", lambda: ["r1", "bad id"], ValueError),
        ("a non-str id in the batch", lambda: ["r1", 5], TypeError),
    ],
    "model_call_id": [
        ("an int", lambda: 5, TypeError),
        ("empty", lambda: "", ValueError),
    ],
    "request_items": [
        ("a str", lambda: "hello", TypeError),
        ("an int", lambda: 5, TypeError),
        ("a dict", lambda: {"role": "user"}, TypeError),
        ("a list holding an int", lambda: [{"role": "user"}, 5], ValueError),
        ("a list holding None", lambda: [None], ValueError),
        ("a list holding a str", lambda: ["hello"], ValueError),
    ],
    "snapshot_id": [("an int", lambda: 5, TypeError)],
    "commit": [
        ("a str", lambda: "not a commit", TypeError),
        ("an int", lambda: 5, TypeError),
        ("an empty dict", lambda: {}, ValueError),
    ],
    "reason": [("an int", lambda: 5, TypeError)],
    "shared_prefixes": [("an int", lambda: 1, TypeError), ("a str", lambda: "yes", TypeError)],
}

# Parameters a method deliberately accepts anything for.
ANY_VALUE = {
    ("mark_incomplete", "model_call_id"),  # the most available write never fails on its id
    ("mark_incomplete_if_open", "model_call_id"),  # the same mark, skipped on a closed rollout
}
# Rows that apply to the token stores only: the in-memory resolver keeps no intents file, so
# it takes any call id (as NeMo Gym's does).
STORES_ONLY = {"an empty call id"}
STORES = {"TokenCaptureStore", "reference.TokenCaptureStore"}


def returns_a_coroutine(function: Any) -> bool:
    """An `async def`, a wrapper of one, or a function annotated to return a coroutine."""
    if inspect.iscoroutinefunction(inspect.unwrap(function)):
        return True
    hint = typing.get_type_hints(function).get("return")
    return typing.get_origin(hint) in (collections.abc.Coroutine, collections.abc.Awaitable)


def async_methods(cls: type) -> list[str]:
    """The public methods of `cls` that are awaited by their callers."""
    return sorted(
        name
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and returns_a_coroutine(member)
    )


def parameters(cls: type, method: str) -> list[str]:
    signature = inspect.signature(getattr(cls, method))
    return [name for name in signature.parameters if name != "self"]


CASES = [
    pytest.param(cls_name, method, param, bad, error, id=f"{cls_name}.{method}-{param}-{what}")
    for cls_name, cls in CLASSES.items()
    for method in async_methods(cls)
    for param in parameters(cls, method)
    if (method, param) not in ANY_VALUE
    for what, bad, error in BAD.get(param, [])
    if what not in STORES_ONLY or cls_name in STORES
]


EXPECTED = {
    "TokenCaptureStore": "put put_unless_stored begin_call begin_call_unless_stored"
    " mark_incomplete"
    " mark_incomplete_if_open freeze drop"
    " retire delete close",
    "reference.TokenCaptureStore": "put begin_call mark_incomplete freeze drop retire delete close",
    "FileLineageStore": "resolve close",
    "reference.FileLineageStore": "resolve close",
    "InMemoryLineageStore": "put resolve delete close",
    "FileCaptureLedger": "record record_failure manifest has_rows resolve retire delete close",
    "PostgresTokenCaptureStore": "put put_unless_stored begin_call mark_incomplete"
    " mark_incomplete_if_open freeze"
    " drop retire delete close"
    " freeze_columns read_entries_async is_incomplete_async read_columns_async",
    "PostgresLineageStore": "resolve close",
    "PostgresCaptureLedger": "record record_failure manifest has_rows resolve retire delete close",
}


def test_every_async_method_is_covered() -> None:
    """Introspection finds the async methods, and each one that takes arguments has rows."""
    covered = {(case.values[0], case.values[1]) for case in CASES}
    for cls_name, cls in CLASSES.items():
        methods = async_methods(cls)
        assert set(EXPECTED[cls_name].split()) <= set(methods), cls_name
        for method in methods:
            params = parameters(cls, method)
            unknown = [p for p in params if p not in VALID]
            assert not unknown, f"{cls_name}.{method}: no table entry for {unknown}"
            if params:
                assert (cls_name, method) in covered, f"{cls_name}.{method}"


def call_args(cls: type, method: str, **override: Any) -> dict[str, Any]:
    return {
        name: override[name] if name in override else VALID[name]()
        for name in parameters(cls, method)
    }


@pytest.mark.parametrize(("cls_name", "method", "param", "bad", "error"), CASES)
async def test_bad_arguments_raise_when_called(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    cls_name: str,
    method: str,
    param: str,
    bad: Callable[[], Any],
    error: type[Exception],
) -> None:
    obj = FACTORIES[cls_name](tmp_path, lambda: str(request.getfixturevalue("pg_dsn")))
    cls = CLASSES[cls_name]
    # The same call with valid arguments is accepted and works when awaited, so the refusal
    # below is the bad argument's.
    await getattr(obj, method)(**call_args(cls, method))
    args = call_args(cls, method, **{param: bad()})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(error):
            getattr(obj, method)(**args)  # not awaited: it must raise right here
        gc.collect()
    leaked = [w for w in caught if "never awaited" in str(w.message)]
    assert not leaked, leaked
    close = getattr(obj, "close", None)
    if close is not None:
        await close()


VALID_CALLS = [
    pytest.param(cls_name, method, id=f"{cls_name}.{method}")
    for cls_name, cls in CLASSES.items()
    for method in async_methods(cls)
    if method != "close"
]


@pytest.mark.parametrize("how", ["closed", "cancelled"])
@pytest.mark.parametrize(("cls_name", "method"), VALID_CALLS)
async def test_a_call_cancelled_before_it_starts_leaves_nothing_unawaited(
    request: pytest.FixtureRequest, tmp_path: Path, cls_name: str, method: str, how: str
) -> None:
    """A valid call's coroutine is made when the method is called (its arguments are checked
    then). Cancelled before its first step (a `wait_for` timeout, a shutdown) or closed, it
    must take every coroutine it made with it: with OpenTelemetry's timing around the call, the
    call's own coroutine was left "never awaited" (an error under `-W error`)."""
    obj = FACTORIES[cls_name](tmp_path, lambda: str(request.getfixturevalue("pg_dsn")))
    cls = CLASSES[cls_name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call = getattr(obj, method)(**call_args(cls, method))
        if how == "closed":
            call.close()
        else:
            task = asyncio.ensure_future(call)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            del task
        del call
        gc.collect()
    leaked = [w for w in caught if "never awaited" in str(w.message)]
    assert not leaked, leaked
    close = getattr(obj, "close", None)
    if close is not None:
        await close()


@pytest.mark.parametrize("factory", [TokenCaptureStore, ReferenceStore])
async def test_nemo_style_synchronous_delete_fails_loudly(
    tmp_path: Path, factory: Callable[[Path], Any]
) -> None:
    """NeMo Gym 0.7.0's `delete(rollout_id)` is synchronous and deletes; called that way ours
    raises at once and changes nothing (the records stay), rather than returning a coroutine
    that never runs. The batch form is `delete_now([rollout_id])`."""
    store = factory(tmp_path)
    await store.put(make_entry("r1", 1))
    with pytest.raises(TypeError, match=r"delete_now\(\[rollout_id\]\)"):
        store.delete("r1")
    assert len(store.read_entries("r1")) == 1
    assert store.delete_now(["r1"]) == {"removed": ["r1"], "absent": []}
    assert store.read_entries("r1") == []


# ---- request content -------------------------------------------------------------------------
#
# A resolve's first step, whatever the resolver holds, is the request's assistant fingerprint
# (as NeMo Gym 0.7.0's): what it refuses was refused by every await, so it is refused when
# `resolve` is called, with the same error (type and message). The conversation digests are
# computed only for candidates that share the fingerprint, so what only they refuse (the
# content of an item the fingerprint does not read) still depends on the rollout's calls and
# is refused when awaited, if at all: the refused set is unchanged, only the moment moves.


class _Item(dict[str, Any]):
    """A dict subclass: the native hashes defer it to `tokencapture.fingerprint`."""


def _user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _assistant(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


# Request items the fingerprint refuses, with the error class awaiting raised.
BAD_CONTENT: list[tuple[str, Callable[[], list[Any]], type[Exception]]] = [
    ("assistant content an int", lambda: [_user("a"), _assistant(5)], ValueError),
    ("assistant content a dict", lambda: [_user("a"), _assistant({"text": "x"})], ValueError),
    ("assistant text a lone surrogate", lambda: [_user("a"), _assistant("\udc00")], UnicodeError),
    (
        "assistant text block a lone surrogate",
        lambda: [_assistant([{"type": "output_text", "text": "ok \ud800"}])],
        UnicodeError,
    ),
    ("a content block an int", lambda: [_assistant([42])], ValueError),
    ("an untyped block without text", lambda: [_assistant([{"data": 1}])], ValueError),
    (
        "a typed block holding a lone surrogate",
        lambda: [_assistant([{"type": "image", "url": "\ud800"}])],
        ValueError,
    ),
    (
        "tool arguments that parse to a lone surrogate",
        lambda: [{"type": "function_call", "name": "f", "arguments": '"\\ud800"'}],
        ValueError,
    ),
    (
        "tool arguments beyond 64 bits",
        lambda: [{"type": "function_call", "name": "f", "arguments": {"n": 2**70}}],
        ValueError,
    ),
    ("a tool call an int", lambda: [{"role": "assistant", "tool_calls": [3]}], TypeError),
    (
        "a tool call function a str",
        lambda: [{"role": "assistant", "tool_calls": [{"function": "f"}]}],
        TypeError,
    ),
    (
        "a dict subclass with bad content",
        lambda: [_user("a"), _Item(role="assistant", content=5)],
        ValueError,
    ),
    (
        "bad content after a float",
        lambda: [_assistant([{"type": "image", "detail": 0.5}]), _assistant(5)],
        ValueError,
    ),
]

RESOLVERS = [
    "FileLineageStore",
    "reference.FileLineageStore",
    "InMemoryLineageStore",
    "FileCaptureLedger",
    "PostgresLineageStore",
    "PostgresCaptureLedger",
]


def fingerprint_error(items: list[Any]) -> BaseException:
    """What `tokencapture.fingerprint` raises for `items`: what every await of a resolve of
    them raised (the native hashes defer such items to it)."""
    with pytest.raises(Exception) as raised:  # any error: compared by the caller
        assistant_fingerprint(items)
    return raised.value


async def _close(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if close is not None:
        await close()


@pytest.mark.parametrize("cls_name", RESOLVERS)
@pytest.mark.parametrize(
    ("items", "error"), [pytest.param(items, error, id=what) for what, items, error in BAD_CONTENT]
)
async def test_content_the_fingerprint_refuses_raises_when_resolve_is_called(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    cls_name: str,
    items: Callable[[], list[Any]],
    error: type[Exception],
) -> None:
    obj = FACTORIES[cls_name](tmp_path, lambda: str(request.getfixturevalue("pg_dsn")))
    expected = fingerprint_error(items())
    assert isinstance(expected, error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(error) as raised:
            obj.resolve("r1", items())  # not awaited: it must raise right here
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
    assert (type(raised.value), str(raised.value)) == (type(expected), str(expected))
    with pytest.raises(error) as raised_now:
        obj.resolve_now("r1", items())
    assert (type(raised_now.value), str(raised_now.value)) == (type(expected), str(expected))
    await _close(obj)


# A committed call per rollout: "r1" answered by the native hashes, "r2" by
# `tokencapture.fingerprint` (a float in its tool arguments, which the native port defers).
QUESTION: list[dict[str, Any]] = [_user("question")]
ANSWERS: dict[str, list[dict[str, Any]]] = {
    "r1": [_assistant("answer")],
    "r2": [{"type": "function_call", "call_id": "f1", "name": "set", "arguments": '{"t": 0.5}'}],
}

# (rollout, request items, expected (status, call id, reason)) of good requests.
GOOD_REQUESTS: list[tuple[str, str, Callable[[], list[Any]], tuple[str, str | None, str]]] = [
    ("native", "r1", lambda: [*QUESTION, *ANSWERS["r1"], _user("next")], ("resolved", "c1", "")),
    (
        "dict subclass",
        "r1",
        lambda: [*QUESTION, _Item(ANSWERS["r1"][0]), _user("next")],
        ("resolved", "c1", ""),
    ),
    (
        "float in tool arguments",
        "r2",
        lambda: [
            *QUESTION,
            *ANSWERS["r2"],
            {"type": "function_call_output", "call_id": "f1", "output": "ok"},
        ],
        ("resolved", "c2", ""),
    ),
    ("root", "r1", lambda: [*QUESTION, _user("more")], ("root", None, "")),
    (
        "no turn of the rollout",
        "r1",
        lambda: [*QUESTION, _assistant("other")],
        ("unresolved", None, "no_match"),
    ),
    # The fingerprint does not read a user turn's content: no candidate shares this request's
    # fingerprint, so no digest reads it either (NeMo Gym 0.7.0 answers the same).
    (
        "a user turn's int content, no candidate",
        "r1",
        lambda: [_user(5), _assistant("other")],
        ("unresolved", None, "no_match"),
    ),
    (
        "an unknown rollout",
        "r9",
        lambda: [*QUESTION, *ANSWERS["r1"]],
        ("unresolved", None, "no_match"),
    ),
]


async def _commit_calls(cls_name: str, obj: Any, root: Path, dsn: Callable[[], str]) -> Any:
    """Commit the call of each rollout of `ANSWERS` where `obj` resolves it; the writer to
    close after, if any."""
    from tests.test_ledger import make_commit

    from tokencapture.lineage import stamp_continuation
    from tokencapture.records import ParentResolutionStatus, stamp_lineage

    if cls_name in ("FileCaptureLedger", "PostgresCaptureLedger"):
        for n, (rollout_id, answer) in enumerate(ANSWERS.items(), 1):
            commit = make_commit(f"c{n}", rollout_id, request=QUESTION, response=answer)
            await obj.record(commit)
        return None
    writer: Any = {
        "FileLineageStore": lambda: TokenCaptureStore(root / "store"),
        "reference.FileLineageStore": lambda: TokenCaptureStore(root / "store"),
        "InMemoryLineageStore": lambda: obj,
        "PostgresLineageStore": lambda: PostgresTokenCaptureStore(dsn(), install_schema=True),
    }[cls_name]()
    for n, (rollout_id, answer) in enumerate(ANSWERS.items(), 1):
        entry = make_entry(rollout_id, f"c{n}", output_items=answer)
        stamp_continuation(entry, QUESTION)
        stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.ROOT)
        await writer.put(entry)
    return None if writer is obj else writer


def _summary(resolution: Any) -> tuple[str, str | None, str]:
    match = resolution.match
    return (
        resolution.status.value,
        None if match is None else match.model_call_id,
        resolution.reason or "",
    )


@pytest.mark.parametrize("cls_name", RESOLVERS)
async def test_good_content_resolves_as_before_and_digest_refusals_wait_for_the_await(
    request: pytest.FixtureRequest, tmp_path: Path, cls_name: str
) -> None:
    """Good requests (the native hashes' and `tokencapture.fingerprint`'s) resolve as
    `resolve_now` does. A request whose only bad content is in a turn the fingerprint does not
    read is accepted when called: the digest that reads it runs only for a candidate, so it is
    refused when awaited, and only then (as `resolve_now` refuses it), exactly as before."""
    dsn = lambda: str(request.getfixturevalue("pg_dsn"))  # noqa: E731
    obj = FACTORIES[cls_name](tmp_path, dsn)
    writer = None
    try:
        writer = await _commit_calls(cls_name, obj, tmp_path, dsn)
        for what, rollout_id, items, expected in GOOD_REQUESTS:
            answer = await obj.resolve(rollout_id, items())
            assert _summary(answer) == expected, what
            assert answer == obj.resolve_now(rollout_id, items()), what
        # A candidate shares the fingerprint and its context covers the user turn: its digest
        # refuses the content when awaited, as `resolve_now` refuses it, with the request's
        # own error (the ledgers too: the request's fault, not a corrupt row's).
        bad_user = [_user(5), *ANSWERS["r1"], _user("next")]
        call = obj.resolve("r1", bad_user)  # accepted when called
        with pytest.raises(ValueError) as raised:
            await call
        with pytest.raises(ValueError) as raised_now:
            obj.resolve_now("r1", bad_user)
        assert (type(raised.value), str(raised.value)) == (
            type(raised_now.value),
            str(raised_now.value),
        )
        assert type(raised.value) is ValueError
        assert str(raised.value) == str(digest_error_of(bad_user[:1]))
    finally:
        # Closed whatever failed: a PostgreSQL connection left open is collected later,
        # inside another test (its ResourceWarning failed a Citus test once).
        if writer is not None:
            await writer.close()
        await _close(obj)


def digest_error_of(items: list[Any]) -> BaseException:
    """What `tokencapture.fingerprint.conversation_digest` raises for `items`."""
    with pytest.raises(ValueError) as raised:
        conversation_digest(items)
    return raised.value


# ---- the request as it was when called ------------------------------------------------------
#
# A resolve answers the request as it was when `resolve` was called: a request list changed
# before the await (a message inserted, a content replaced) does not change the answer, on the
# native path (its job holds the items copied natively) as on the Python one (items the port
# does not cover are copied when called, then hashed by `tokencapture.fingerprint`). Each
# change below would change the answer of a resolve that read the list when awaited: the
# question is the context every call of `ANSWERS` recorded.


def _replace_question(items: list[Any]) -> None:
    items[0] = _user("another question")


def _edit_question(items: list[Any]) -> None:
    items[0]["content"] = "another question"


def _insert_first(items: list[Any]) -> None:
    items.insert(0, {"role": "system", "content": "Be brief."})


CHANGES: list[tuple[str, Callable[[list[Any]], None]]] = [
    ("the question replaced", _replace_question),
    ("the question's content edited", _edit_question),
    ("a message inserted first", _insert_first),
    ("the list emptied", list.clear),
]

# (what, rollout, a fresh request, expected call id, whether the port fingerprints it)
AS_CALLED: list[tuple[str, str, Callable[[], list[Any]], str, bool]] = [
    ("native", "r1", lambda: [_user("question"), _assistant("answer"), _user("next")], "c1", True),
    (
        "Python: a float in tool arguments",
        "r2",
        lambda: [
            _user("question"),
            {"type": "function_call", "call_id": "f1", "name": "set", "arguments": '{"t": 0.5}'},
            {"type": "function_call_output", "call_id": "f1", "output": "ok"},
        ],
        "c2",
        False,
    ),
    (
        "Python: a dict subclass",
        "r1",
        lambda: [_user("question"), _Item(role="assistant", content="answer"), _user("next")],
        "c1",
        False,
    ),
]


@pytest.mark.parametrize("cls_name", RESOLVERS)
async def test_a_request_changed_before_the_await_resolves_as_it_was_called(
    request: pytest.FixtureRequest, tmp_path: Path, cls_name: str
) -> None:
    from tokencapture import _core

    dsn = lambda: str(request.getfixturevalue("pg_dsn"))  # noqa: E731
    obj = FACTORIES[cls_name](tmp_path, dsn)
    writer = None
    try:
        writer = await _commit_calls(cls_name, obj, tmp_path, dsn)
        for what, rollout_id, fresh, call_id, native in AS_CALLED:
            assert (_core.request_fingerprint(fresh()) is not None) is native, what
            expected = obj.resolve_now(rollout_id, fresh())
            assert _summary(expected) == ("resolved", call_id, ""), what
            for change_name, change in CHANGES:
                items = fresh()
                call = obj.resolve(rollout_id, items)
                change(items)
                # Read when awaited, the changed list would answer otherwise.
                assert _summary(obj.resolve_now(rollout_id, items)) != _summary(expected)
                assert await call == expected, (what, change_name)
    finally:
        if writer is not None:
            await writer.close()
        await _close(obj)


# A committed call whose recorded context holds a float in a part of a turn the fingerprint
# does not read: the port fingerprints the request, then declines that context's digest, and
# the resolve goes on in Python (the Python path of a native job).
_FLOAT_QUESTION: Callable[[], dict[str, Any]] = lambda: _user(  # noqa: E731
    [{"type": "input_text", "text": "question"}, {"type": "input_image", "detail": 1.5}]
)


@pytest.mark.parametrize(
    "cls_name", ["FileLineageStore", "InMemoryLineageStore", "reference.FileLineageStore"]
)
async def test_a_native_job_handed_to_python_resolves_the_list_as_it_was_called(
    tmp_path: Path, cls_name: str
) -> None:
    """A job the port fingerprinted but whose context digest it declines is resolved by
    Python's digests: of the list as it was when called (a message inserted first, the
    question replaced, the list emptied: the answer is unchanged). The job's copy of the
    items stays the port's, so an item's content edited in place is read when awaited."""
    from tokencapture import _core
    from tokencapture.lineage import stamp_continuation
    from tokencapture.records import ParentResolutionStatus, stamp_lineage

    obj = FACTORIES[cls_name](tmp_path, lambda: "")
    writer = obj if cls_name == "InMemoryLineageStore" else TokenCaptureStore(tmp_path / "store")
    try:
        entry = make_entry("r1", "c1", output_items=[_assistant("answer")])
        stamp_continuation(entry, [_FLOAT_QUESTION()])
        stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.ROOT)
        await writer.put(entry)
        fresh = lambda: [_FLOAT_QUESTION(), _assistant("answer"), _user("next")]  # noqa: E731
        assert _core.request_fingerprint(fresh()) is not None
        assert _core.continuation_hashes(fresh(), 1) is None  # the port declines the digest
        expected = obj.resolve_now("r1", fresh())
        assert _summary(expected) == ("resolved", "c1", "")
        for change_name, change in [*CHANGES[:1], *CHANGES[2:]]:
            items = fresh()
            call = obj.resolve("r1", items)
            change(items)
            assert _summary(obj.resolve_now("r1", items)) != _summary(expected)
            assert await call == expected, change_name
    finally:
        if writer is not obj:
            await writer.close()
        await _close(obj)


@pytest.mark.parametrize("cls_name", ["InMemoryLineageStore", "reference.FileLineageStore"])
async def test_a_field_too_deep_to_copy_is_kept_as_it_is(tmp_path: Path, cls_name: str) -> None:
    """The Python path copies the request's containers when called; a field nested deeper
    than Python's recursion allows is kept uncopied rather than refused: the hashes do not
    read it (an unknown field), so the request resolves as it did before the copy."""
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(5_000):
        inner["a"] = {}
        inner = inner["a"]
    obj = FACTORIES[cls_name](tmp_path, lambda: "")
    writer = await _commit_calls(cls_name, obj, tmp_path, lambda: "")
    try:
        items = [{**_user("question"), "metadata": deep}, _assistant("answer"), _user("next")]
        answer = await obj.resolve("r1", items)
        assert _summary(answer) == ("resolved", "c1", "")
        assert answer == obj.resolve_now("r1", items)
    finally:
        if writer is not None:
            await writer.close()
        await _close(obj)
