"""`tokencapture.model_building`: models built from checked fields without ``model_construct``'s
per-field lookups must be indistinguishable from what ``model_construct`` builds, and every
model or set of fields the direct way does not fit must go through ``model_construct``."""

from __future__ import annotations

from typing import Any

import orjson
import pydantic
from tests.conftest import make_entry, model_state

from tokencapture import model_building
from tokencapture.records import TokenEntry
from tokencapture.staging_records import StagedCallBaseSnapshot
from tokencapture.store import canonical_line


def _same_as_model_construct(cls: type[pydantic.BaseModel], rows: list[dict[str, Any]]) -> None:
    built = model_building.construct_all(cls, [dict(row) for row in rows])
    expected = [cls.model_construct(**row) for row in rows]
    assert [model_state(m) for m in built] == [model_state(m) for m in expected]


def test_token_entries_are_built_the_fast_way_and_keep_extras_through_model_construct() -> None:
    record = orjson.loads(canonical_line(make_entry("r", "c1")))
    _same_as_model_construct(TokenEntry, [record])
    # TokenEntry keeps extras (extra="allow"): its direct build sets them to {} as
    # model_construct does, and a freeze's entries take the direct way.
    assert model_building.fast_way(TokenEntry)
    with_extra = {**record, "custom_tag": {"k": [1, 2]}}
    built = model_building.construct(TokenEntry, dict(with_extra))
    assert built.__pydantic_extra__ == {"custom_tag": {"k": [1, 2]}}
    _same_as_model_construct(TokenEntry, [with_extra])


def test_a_row_without_a_field_gets_its_default_from_model_construct() -> None:
    class Defaulted(pydantic.BaseModel):
        a: int
        b: int = 5

    # The first call lacks a field: the class stays unchecked, then a whole row checks it.
    _same_as_model_construct(Defaulted, [{"a": 1}])
    assert not model_building.fast_way(Defaulted)
    _same_as_model_construct(Defaulted, [{"a": 1, "b": 2}, {"a": 3}, {"a": 4, "b": 6}])
    assert model_building.fast_way(Defaulted)


def test_an_extra_key_of_a_model_that_ignores_extras_goes_through_model_construct() -> None:
    class Plain(pydantic.BaseModel):
        a: int
        b: int

    _same_as_model_construct(Plain, [{"a": 1, "b": 2}, {"a": 1, "z": 9}, {"a": 1, "b": 2, "z": 9}])
    assert model_building.fast_way(Plain)


def test_models_the_direct_way_does_not_fit_are_built_by_model_construct() -> None:
    class Aliased(pydantic.BaseModel):
        a: int = pydantic.Field(alias="b")

    class Private(pydantic.BaseModel):
        a: int
        _p: int = 3

    class PostInit(pydantic.BaseModel):
        a: int

        def model_post_init(self, context: Any, /) -> None:
            object.__setattr__(self, "a", self.a + 1)

    class Root(pydantic.RootModel[int]):
        pass

    for cls, row in (
        (Aliased, {"b": 1}),
        (Private, {"a": 1}),
        (PostInit, {"a": 1}),
        (Root, {"root": 1}),
    ):
        _same_as_model_construct(cls, [row, row])
        assert not model_building.fast_way(cls), cls


def test_a_model_whose_model_construct_differs_is_caught_by_the_first_check() -> None:
    """Stands for a pydantic version whose ``model_construct`` sets something the direct way
    does not: the first build compares the two and keeps ``model_construct``."""

    class Marked(pydantic.BaseModel):
        a: int

        @classmethod
        def model_construct(cls, _fields_set: set[str] | None = None, **values: Any) -> Any:
            model = super().model_construct(_fields_set, **values)
            object.__setattr__(model, "__pydantic_fields_set__", {"marked"})
            return model

    _same_as_model_construct(Marked, [{"a": 1}, {"a": 2}])
    assert not model_building.fast_way(Marked)


def test_staging_snapshots_are_built_the_fast_way() -> None:
    fields = {name: None for name in StagedCallBaseSnapshot.model_fields}
    _same_as_model_construct(StagedCallBaseSnapshot, [fields])
    assert model_building.fast_way(StagedCallBaseSnapshot)


def test_each_model_owns_its_bookkeeping() -> None:
    record = orjson.loads(canonical_line(make_entry("r", "c1")))
    first, second = (model_building.construct(TokenEntry, dict(record)) for _ in range(2))
    first.model_call_id = "changed"
    assert second.model_call_id == "c1"
    assert first.__pydantic_fields_set__ is not second.__pydantic_fields_set__
    assert first.__dict__ is not second.__dict__


def test_a_given_dict_in_field_order_becomes_the_model_dict_and_any_other_is_copied() -> None:
    """``given=True`` (a fetch's fresh dicts): a dict naming the fields in field order is the
    model's ``__dict__`` itself; one in another order is copied in field order; without
    ``given`` every dict is copied. The models are ``model_construct``'s either way."""

    class Pair(pydantic.BaseModel):
        a: int
        b: list[int]

    model_building.construct(Pair, {"a": 0, "b": []})  # the class's first build: checked
    in_order, reordered, kept = {"a": 1, "b": [2]}, {"b": [4], "a": 3}, {"a": 5, "b": [6]}
    given = model_building.construct_all(Pair, [in_order, reordered], given=True)
    copied = model_building.construct(Pair, kept)
    assert given[0].__dict__ is in_order
    assert given[1].__dict__ is not reordered
    assert list(given[1].__dict__.items()) == [("a", 3), ("b", [4])]
    assert copied.__dict__ is not kept
    assert [model_state(m) for m in [*given, copied]] == [
        model_state(Pair.model_construct(**row))
        for row in ({"a": 1, "b": [2]}, {"a": 3, "b": [4]}, {"a": 5, "b": [6]})
    ]
