"""Pydantic's validation errors as sentences that name each bad key's path and say what the key
wants (the field's `Expect` words), for `ckptd.config`'s loader.
"""

from __future__ import annotations

import difflib
from typing import Any, TypeVar

from pydantic import BaseModel, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from ckptd.config.fields import Expect, _show, _toml_key

_M = TypeVar("_M", bound=BaseModel)

_GENERIC_EXPECT = {
    "int_type": "a whole number",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "model_type": "a table",
    "dict_type": "a table",
    "tuple_type": "a list",
    "list_type": "a list",
}


def _validate(
    model: type[_M], raw: dict[str, Any], context: dict[str, Any]
) -> tuple[_M | None, list[tuple[tuple[str | int, ...], str]]]:
    try:
        return model.model_validate(raw, context=context), []
    except ValidationError as e:
        return None, [(tuple(err["loc"]), _sentence(model, err)) for err in e.errors()]


def _sentence(model: type[BaseModel], err: ErrorDetails) -> str:
    loc = tuple(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _model_at(model, loc[:-1])
        return _unknown_key("", str(loc[-1]), tuple(parent.model_fields) if parent else ())
    if kind == "missing":
        return "is required"
    if kind == "value_error":
        return str(err.get("ctx", {}).get("error", err["msg"]))
    field = _field_at(model, loc)
    expect = _expected(field, kind)
    if field is not None and field.annotation is SecretStr:
        return f"must be {expect} (the value is secret, so not shown)"
    return f"must be {expect}, got {_show(err['input'])}"


def _expected(field: FieldInfo | None, kind: str) -> str:
    for meta in field.metadata if field is not None else []:
        if isinstance(meta, Expect):
            return meta.words
    return _GENERIC_EXPECT.get(kind, "a valid value")


def _unknown_key(prefix: str, key: str, known: tuple[str, ...]) -> str:
    guess = difflib.get_close_matches(key, known, n=1)
    hint = f' (did you mean "{guess[0]}"?)' if guess else ""
    return f"{prefix}: unknown key{hint}" if prefix else f"unknown key{hint}"


def _model_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    for part in loc:
        field = model.model_fields.get(str(part))
        inner = field.annotation if field is not None else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return None
        model = inner
    return model


def _field_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> FieldInfo | None:
    parent = _model_at(model, loc[:-1]) if loc else None
    return parent.model_fields.get(str(loc[-1])) if parent is not None else None


def _key_path(prefix: str, loc: tuple[str | int, ...]) -> str:
    parts = [prefix] if prefix else []
    parts += [_toml_key(str(part)) for part in loc]
    return ".".join(parts)
