"""TokenEntry validation, lineage stamping, and the protocol module's rules."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from tests.conftest import make_entry

from tokencapture import protocols
from tokencapture.protocols import (
    LineageMatch,
    LineageResolution,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
    TokenSink,
    TokenSource,
)
from tokencapture.records import (
    TOKEN_FIELDS,
    ParentResolutionStatus,
    TokenEntry,
    compute_digest,
    cumulative_tokens,
    stamp_lineage,
)
from tokencapture.store import TokenCaptureStore


def independent_digest(ids: list[int]) -> str:
    body = b"nemo-gym-tokens"
    if ids:
        body += (
            bytes([1]) + struct.pack(">Q", len(ids)) + b"".join(struct.pack(">Q", i) for i in ids)
        )
    return hashlib.sha256(body).hexdigest()


def test_defaults_and_field_order_follow_the_reference() -> None:
    entry = TokenEntry(
        rollout_id="r",
        model_call_id="c",
        prompt_token_ids=[],
        generation_token_ids=[],
        generation_log_probs=[],
    )
    assert list(TokenEntry.model_fields)[:3] == ["schema_version", "rollout_id", "model_call_id"]
    assert entry.schema_version == 1 and entry.model == "" and entry.output_items == []
    assert entry.parent_resolution is None and entry.continuation_fingerprint == ""
    assert TOKEN_FIELDS == (
        "prompt_token_ids",
        "generation_token_ids",
        "generation_log_probs",
        "routed_experts",
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"schema_version": 2}, "understands up to 1"),
        ({"schema_version": 0}, "below the supported minimum 1"),
        ({"generation_log_probs": [-0.1]}, r"same length \(got 2 and 1\)"),
        ({"token_item_index": 0}, "token_item_index 0 is outside output_items of length 0"),
        ({"parent_resolution": "resolved"}, "resolved parent metadata requires parent_call_id"),
        ({"parent_resolution": "root", "parent_call_id": "p"}, "root parent metadata cannot"),
        ({"parent_resolution": "unresolved", "parent_call_id": "p"}, "unresolved parent metadata"),
        ({"prompt_is_delta": True}, "a delta prompt requires a RESOLVED parent_call_id"),
    ],
)
def test_validation_rules(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        make_entry(**fields)
    assert isinstance(info.value, ValueError)


def test_valid_parent_combinations() -> None:
    make_entry(parent_resolution="resolved", parent_call_id="p", prompt_is_delta=True)
    make_entry(parent_resolution="root")
    make_entry(output_items=[{"type": "message"}], token_item_index=0)


def test_digest_matches_an_independent_implementation() -> None:
    for ids in ([], [0], [5, 2**64 - 1, 3], list(range(2000))):
        assert compute_digest(ids) == independent_digest(ids)


def test_cumulative_tokens_and_stamp_lineage() -> None:
    entry = make_entry(
        prompt_token_ids=[1, 2], generation_token_ids=[3], generation_log_probs=[-1.0]
    )
    assert cumulative_tokens(entry) == [1, 2, 3]
    stamped = stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.ROOT)
    assert stamped is entry and entry.cum_len == 3 and entry.digest == independent_digest([1, 2, 3])
    with pytest.raises(ValueError, match="disagree with the entry's own arrays"):
        stamp_lineage(entry, None, cumulative=[9, 9, 9])
    with pytest.raises(ValueError, match="requires parent_call_id"):
        stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.RESOLVED)
    delta = make_entry(
        prompt_token_ids=[4],
        generation_token_ids=[5],
        generation_log_probs=[-1.0],
        parent_call_id="p",
        parent_resolution="resolved",
        prompt_is_delta=True,
    )
    with pytest.raises(ValueError, match="delta"):
        cumulative_tokens(delta)
    stamp_lineage(
        delta, "p", parent_resolution=ParentResolutionStatus.RESOLVED, cumulative=[1, 2, 3, 4, 5]
    )
    assert delta.cum_len == 5 and delta.digest == independent_digest([1, 2, 3, 4, 5])


def test_status_is_a_str_enum() -> None:
    assert ParentResolutionStatus("resolved") == "resolved"
    assert [s.value for s in ParentResolutionStatus] == ["root", "resolved", "unresolved"]


def test_exception_hierarchy() -> None:
    assert issubclass(TokenCaptureFrozenError, RuntimeError)
    assert issubclass(TokenCaptureRetiredError, TokenCaptureFrozenError)
    assert issubclass(protocols.RolloutRetiredError, LookupError)


def test_lineage_resolution_rules() -> None:
    match = LineageMatch("c", (1, 2), "d")
    assert LineageResolution(ParentResolutionStatus.RESOLVED, match).match is match
    with pytest.raises(ValueError):
        LineageResolution(ParentResolutionStatus.RESOLVED)
    with pytest.raises(ValueError):
        LineageResolution(ParentResolutionStatus.ROOT, match)
    with pytest.raises(ValueError):
        LineageResolution(ParentResolutionStatus.UNRESOLVED, match, "no_match")
    assert (
        LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="ambiguous").reason
        == "ambiguous"
    )


def test_store_satisfies_the_runtime_protocols(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    assert isinstance(store, TokenSink) and isinstance(store, TokenSource)
    assert not isinstance(object(), TokenSink)


def test_install_functions(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    try:
        protocols.install_token_sink(store)
        assert protocols.installed_token_sink() is store
        protocols.install_token_source(store)
        assert protocols.installed_token_source() is store

        class NoMark:
            async def put(self, entry: TokenEntry) -> None: ...

            async def close(self) -> None: ...

        with pytest.raises(TypeError, match="mark_incomplete"):
            protocols.install_token_sink(NoMark())  # type: ignore[arg-type]
        assert protocols.installed_token_sink() is store
        protocols.install_token_sink(None)
        assert protocols.installed_token_sink() is None
        with pytest.raises(TypeError):
            protocols.install_lineage_store(object())  # type: ignore[arg-type]
    finally:
        protocols.install_token_sink(None)
        protocols.install_token_source(None)
        protocols.install_lineage_store(None)


def test_every_name_on_the_seed_pages_exists() -> None:
    import tokencapture
    import tokencapture.store as store_module

    protocol_names = """
        CaptureLedger LineageMatch LineageResolution LineageResolver RolloutRemovalPayload
        RolloutRetiredError TokenCaptureFrozenError TokenCaptureRetiredError TokenCaptureSnapshot
        TokenSink TokenSource install_lineage_store install_token_sink install_token_source
        installed_lineage_store installed_token_sink installed_token_source
        _INSTALLED_LINEAGE_STORE _INSTALLED_SINK _INSTALLED_SOURCE
    """
    store_functions = "TokenCaptureStore make_token_store validate_rollout_id validate_rollout_ids"
    store_methods = """
        _begin_call _drop _mark_incomplete append begin_call close delete delete_now drop freeze
        freeze_now incomplete_path_for intents_path_for is_incomplete lock_path_for
        mark_incomplete path_for put read_entries retire retire_now state_path_for root
    """
    for name in protocol_names.split():
        assert hasattr(protocols, name), name
    for name in [*store_functions.split(), "logger"]:
        assert hasattr(store_module, name), name
    for name in store_methods.split():
        assert hasattr(TokenCaptureStore, name), name
    for name in tokencapture.__all__:
        assert hasattr(tokencapture, name), name


PUBLIC_MODULES = (
    "tokencapture.protocols",
    "tokencapture.records",
    "tokencapture.store",
    "tokencapture.lineage",
    "tokencapture.ledger",
    "tokencapture.staging.records",
    "tokencapture.fingerprint",
    "tokencapture.config",
)


def public_annotated_objects() -> list[tuple[str, object]]:
    """Every public class, function and method (properties' getters included) of the modules
    above, by qualified name."""
    import importlib
    import inspect

    found: list[tuple[str, object]] = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None) or [
            name for name in vars(module) if not name.startswith("_")
        ]
        for name in names:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                found.append((f"{module_name}.{name}", obj))
            elif inspect.isclass(obj):
                found.append((f"{module_name}.{name}", obj))
                for attr, member in vars(obj).items():
                    if attr.startswith("_") and attr not in ("__init__", "__post_init__"):
                        continue
                    if isinstance(member, staticmethod | classmethod):
                        member = member.__func__
                    elif isinstance(member, property):
                        member = member.fget
                    if inspect.isfunction(member):
                        found.append((f"{module_name}.{name}.{attr}", member))
    return found


def test_every_public_annotation_resolves_at_run_time() -> None:
    import typing

    objects = public_annotated_objects()
    assert len(objects) > 100  # the walk found the modules' contents
    failures = []
    for qualified, obj in objects:
        try:
            typing.get_type_hints(obj)
        except Exception as exc:
            failures.append(f"{qualified}: {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_module_annotations_resolve_at_run_time(module_name: str) -> None:
    import importlib
    import typing

    typing.get_type_hints(importlib.import_module(module_name))


def test_capture_ledger_record_names_the_commit_model() -> None:
    import typing

    from tokencapture.staging.records import CaptureLedgerCommit

    hints = typing.get_type_hints(protocols.CaptureLedger.record)
    assert hints["commit"] is CaptureLedgerCommit
