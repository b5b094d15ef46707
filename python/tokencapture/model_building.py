"""Pydantic models built from fields a reader already checked, without ``model_construct``'s
per-field lookups.

A freeze builds every entry of a snapshot and a staging fetch every snapshot it returns, from
dicts the native decoder produced and verified. ``cls.model_construct(**fields)`` then spends
most of its time looking up aliases and defaults that such dicts never need: a `TokenEntry`
takes it 6.3-7.6 us against 3.1-3.3 us the direct way (a loaded 2-core machine). `construct`
sets what ``model_construct`` would set (the instance's ``__dict__`` in field order, its
fields set, its extra and private values) directly, for plain models (no aliases, no
post-init, no private attributes, not a root model) and fields that name exactly the
model's fields. The first time a class is built, the two ways are compared on
that call's fields; a model or a pydantic version where they differ is built by
``model_construct`` from then on. Anything else (a missing field, so a default applies, or a
key that is not a field, which a model with ``extra="allow"`` keeps) goes through
``model_construct`` too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

__all__ = ["construct", "construct_all", "fast_way"]

Model = TypeVar("Model", bound=BaseModel)

_new = object.__new__
_set = object.__setattr__
# Per class: its fast constructor (given the fields and whether it may keep their dict), or
# None where `model_construct` is used. A class is absent until a call brings fields naming
# exactly its fields (the sample the two ways are compared on).
_builders: dict[type[BaseModel], Callable[[dict[str, Any], bool], Any] | None] = {}


def construct(cls: type[Model], fields: dict[str, Any], *, given: bool = False) -> Model:
    """``cls.model_construct(**fields)``, the faster way where it gives the same model.

    `given`: the caller gives `fields` away (a fetch's freshly decoded dict, used for nothing
    else): a dict naming the fields in field order then becomes the model's ``__dict__``
    itself, as ``model_construct`` would have copied it; otherwise it is copied."""
    if cls not in _builders:
        return _first(cls, fields)
    build = _builders[cls]
    if build is not None:
        try:
            return build(fields, given)  # type: ignore[no-any-return]
        except KeyError:  # not exactly the model's fields
            pass
    return cls.model_construct(**fields)


def construct_all(
    cls: type[Model], rows: list[dict[str, Any]], *, given: bool = False
) -> list[Model]:
    """``[construct(cls, fields, given=given) for fields in rows]``."""
    return [construct(cls, fields, given=given) for fields in rows]


def fast_way(cls: type[BaseModel]) -> bool:
    """Whether `cls` is built without ``model_construct`` (known once a call has checked it)."""
    return _builders.get(cls) is not None


def _first(cls: type[Model], fields: dict[str, Any]) -> Model:
    """A class's first build: make its fast constructor and check it against
    ``model_construct`` on `fields`, remembering the verdict; fields that do not name exactly
    the model's fields leave the class unchecked for a later call."""
    build = _fast_constructor(cls)
    slow = cls.model_construct(**fields)
    if build is None:
        _builders[cls] = None
        return slow
    try:
        fast = build(fields, False)
    except KeyError:
        return slow
    same = (
        list(fast.__dict__.items()) == list(slow.__dict__.items())
        and fast.__pydantic_fields_set__ == slow.__pydantic_fields_set__
        and fast.__pydantic_extra__ == slow.__pydantic_extra__
        and fast.__pydantic_private__ == slow.__pydantic_private__
    )
    _builders[cls] = build if same else None
    return slow


def _fast_constructor(cls: type[BaseModel]) -> Callable[[dict[str, Any], bool], Any] | None:
    """The direct way for a plain pydantic model; None for any other class."""
    fields = getattr(cls, "__pydantic_fields__", None)
    if (
        not isinstance(fields, dict)
        or getattr(cls, "__pydantic_root_model__", True)
        or getattr(cls, "__pydantic_post_init__", True)
        or getattr(cls, "__private_attributes__", True)
    ):
        return None
    for name, field in fields.items():
        if getattr(field, "alias", name) not in (None, name):
            return None
        if getattr(field, "validation_alias", name) not in (None, name):
            return None
    names = tuple(fields)
    count = len(names)
    every = frozenset(names)
    # What model_construct keeps as extra values when given none: {} where the model allows
    # extras, None otherwise.
    keeps_extra = cls.model_config.get("extra") == "allow"

    def build(values: dict[str, Any], given: bool) -> Any:
        if len(values) != count:  # a field missing (a default applies) or an extra key
            raise KeyError
        model = _new(cls)
        # Exactly the fields in field order: what model_construct would copy it into.
        if not (given and tuple(values) == names):
            values = {name: values[name] for name in names}
        _set(model, "__dict__", values)
        _set(model, "__pydantic_fields_set__", set(every))
        _set(model, "__pydantic_extra__", {} if keeps_extra else None)
        _set(model, "__pydantic_private__", None)
        return model

    return build
