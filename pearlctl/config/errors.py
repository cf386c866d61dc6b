"""Pydantic's validation errors in the house's words: ``problems_from`` makes each one a SpecProblem,
``key.path: what is wrong``, saying what would be valid, so a TOML document validated by pydantic models
reports every problem at once, each where it is. The run spec's tables (pearlctl.config.tables) use it, and so
may any other TOML file read through pydantic models.

A model says what a key takes in the key's ``Field(description=...)`` ("an integer >= 1 and <= 4096"; on a
type alias too: ``Annotated[int, Field(ge=1, description=...)]``), and pydantic's own checks are worded with it:

- a key that is missing: ``is required: <description>``;
- a key the model does not have: ``unknown key (did you mean 'nodes'?); valid keys: nodes, ...`` (a model
  whose keys are other things names them in ``key_noun``: ``unknown pool ...; valid pools: ...``);
- nan or inf: ``must be a finite number (not nan or inf): <description>, got nan``;
- a value where a table belongs: ``must be a table, got int``;
- a value not among a ``Literal``'s: ``must be <description>; got <the value>`` (``one of a, b``);
- any other wrong type, bound or form: ``must be <description>, got <the value>``.

A validator with more to say raises ``problem(message)``: the message is reported as it is, at the key the
validator checks, or at a key below it (``at``); ``problems`` reports several at once (a rule between keys,
each problem where it is). A validator that finds a value not of its key's form raises ``invalid()``: it is
worded as pydantic's own checks are.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from pearlctl.config.problems import SpecProblem
from pearlctl.config.values import printable_key

_SAID = "said"  # the error type of problem(): its message is reported as it is
_INVALID = "invalid"  # the error type of invalid(): worded from the key's description
_TABLE_ERRORS = ("model_type", "model_attributes_type", "dict_type")


def problem(message: str, *, at: str = "") -> PydanticCustomError:
    """What a validator raises to report ``message`` as it is: at the key it checks, or at ``at`` below it
    (``PEARL_RDZV_PORT`` under ``env``)."""
    return problems({at: message})


def problems(found: Mapping[str, str]) -> PydanticCustomError:
    """What a validator raises to report several problems at once, each at its key below the one it checks
    (``""``: that key itself): a model validator's, at keys of its table."""
    return PydanticCustomError(_SAID, "{message}", {"message": "; ".join(found.values()), "at": dict(found)})


def invalid() -> PydanticCustomError:
    """What a validator raises for a value not of its key's form: ``must be <description>, got <value>``."""
    return PydanticCustomError(_INVALID, "not of the form this key takes")


def problems_from(exc: ValidationError, model: type[BaseModel]) -> list[SpecProblem]:
    """Every error of ``exc`` (raised validating a document as ``model``) as a SpecProblem at its key path."""
    found = []
    for error in exc.errors(include_url=False):
        loc = tuple(part for part in error["loc"] if part != "[key]")  # a dict key's own error: at that key
        if error["type"] == _SAID:
            for below, message in error["ctx"]["at"].items():
                found.append(SpecProblem(key_path((*loc, below) if below else loc), message))
        else:
            found.append(SpecProblem(key_path(loc), _worded(error, *_table_and_key(model, loc))))
    return found


def key_path(loc: tuple[str | int, ...]) -> str:
    """``("pools", "trainer", "command", 2)`` as ``pools.trainer.command[2]``, printable on one line."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f"{'.' if path else ''}{part}"
    return printable_key(path) or "<file>"


def _worded(error: Any, table: type[BaseModel] | None, field: FieldInfo | None) -> str:
    kind, value = error["type"], error["input"]
    if kind == "extra_forbidden" and table is not None:
        noun = getattr(table, "key_noun", "key")
        keys = tuple(table.model_fields)
        close = difflib.get_close_matches(str(error["loc"][-1]), keys, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown {noun}{hint}; valid {noun}s: {', '.join(keys)}"
    if kind in _TABLE_ERRORS:
        return f"must be a table, got {type(value).__name__}"
    what = _description(field) if field is not None else None
    if what is None:
        return f"{error['msg']}, got {value!r}"
    if kind == "missing":
        return f"is required: {what}"
    if kind == "finite_number":
        return f"must be a finite number (not nan or inf): {what}, got {value!r}"
    if kind == "literal_error":
        return f"must be {what}; got {value!r}"
    return f"must be {what}, got {value!r}"


def _table_and_key(model: type[BaseModel], loc: tuple[str | int, ...]) -> tuple[type[BaseModel] | None, Any]:
    """The model of the table ``loc`` ends in and its key's field there (None where ``loc`` is no key of it);
    (None, None) where ``loc`` goes below the models (into a list, or a table of free keys)."""
    if not loc:
        return None, None
    table: type[BaseModel] | None = model
    for part in loc[:-1]:
        field = table.model_fields.get(part) if isinstance(part, str) else None
        table = _model_of(field.annotation) if field is not None else None
        if table is None:
            return None, None
    return table, table.model_fields.get(loc[-1]) if isinstance(loc[-1], str) else None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model an annotation holds (``Pool`` of ``Pool | None``), or None."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for candidate in typing.get_args(annotation) if union else (annotation,):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _description(field: FieldInfo) -> str | None:
    """What the key takes: its field's description, or that of the type alias in its ``X | None``."""
    if field.description:
        return field.description
    for arg in typing.get_args(field.annotation):
        for meta in getattr(arg, "__metadata__", ()):
            if getattr(meta, "description", None):
                return meta.description
    return None
