"""How a pydantic validation error of the ``precision`` section becomes a :class:`Problem` a person can act on: the
JSON path (``precision.weights.storage``), what was found, and the allowed values read from the schema."""

from __future__ import annotations

import difflib
import json
import typing
from typing import Any

from pydantic import BaseModel

from .problems import Problem
from .schema import AUTO_ADVICE, PrecisionConfig

SECTION = "precision"


def _json_path(loc: tuple) -> str:
    parts = [SECTION]
    for item in loc:
        if isinstance(item, int):
            parts[-1] += f"[{item}]"
        else:
            parts.append(str(item))
    return ".".join(parts)


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that holds the field at ``loc`` (None when loc leaves the models)."""
    model: type[BaseModel] | None = PrecisionConfig
    for name in loc[:-1]:
        field = model.model_fields.get(str(name))
        model = _section_model(field.annotation) if field is not None else None
        if model is None:
            return None
    return model


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a sub-section field: ``Model`` or ``Model | None`` (an optional section such as
    ``schedule.spike_guard``), else None."""
    for member in (annotation, *typing.get_args(annotation)):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _field_at(loc: tuple) -> Any:
    """The pydantic FieldInfo at ``loc``, or None."""
    model = _model_at(loc)
    return model.model_fields.get(str(loc[-1])) if model is not None and loc else None


def _registered_values(field: Any) -> list | None:
    """The values of a field whose allowed set is known only at run time (``precision.kernel``: the registered
    backends), read from the JSON-schema ``enum`` its ``json_schema_extra`` writes; None for other fields."""
    extra = getattr(field, "json_schema_extra", None)
    if not callable(extra):
        return None
    schema: dict = {}
    extra(schema)
    return next((m["enum"] for m in schema.get("anyOf", [schema]) if "enum" in m), None)


def _allowed_values(loc: tuple) -> tuple[str, ...]:
    field = _field_at(loc)
    if field is None:
        return ()
    values: list[str] = []
    ann = field.annotation
    registered = _registered_values(field)
    if registered is not None:
        values = [json.dumps(v) for v in registered]
        return tuple([*values, "null"] if type(None) in typing.get_args(ann) else values)
    members = (ann,) if typing.get_origin(ann) is typing.Literal else (typing.get_args(ann) or (ann,))
    for arg in members:
        if typing.get_origin(arg) is typing.Literal:
            values += [repr(v).replace("'", '"') for v in typing.get_args(arg)]
        elif arg is type(None):
            values.append("null")
    return tuple(values)


def _auto_locs(value: Any, loc: tuple = ()) -> list[tuple]:
    """Locations (key/index tuples) of every ``"auto"`` string in a JSON value."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return [loc]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _auto_locs(v, (*loc, k))]
    if isinstance(value, list):
        return [x for i, v in enumerate(value) for x in _auto_locs(v, (*loc, i))]
    return []


def _find_auto(value: Any) -> list[Problem]:
    problems = []
    for loc in _auto_locs(value):
        key = str(loc[-1]) if loc else SECTION
        advice = AUTO_ADVICE.get(key, f"write the value explicitly (the default is {_default_at(loc)})")
        problems.append(Problem(_json_path(loc), '"auto" is not allowed here: HF Accelerate raises on any "auto" it '
                                                 f"cannot fill, and this section has nothing to fill it from; {advice}",
                                _allowed_values(loc)))
    return problems


def _default_at(loc: tuple) -> str:
    node: Any = PrecisionConfig().model_dump(mode="json")
    for k in loc:
        try:
            node = node[k]
        except (KeyError, IndexError, TypeError):
            return "documented in docs/config.md"
    return json.dumps(node)


def _union_field(loc: tuple) -> tuple | None:
    """``loc`` of an error inside one member of a union-typed field (pydantic appends the member's tag, e.g.
    ``("schedule", "bf16_from", "int")``): the field's own loc, else None."""
    if len(loc) < 2 or _model_at(loc) is not None:
        return None
    holder = _model_at(loc[:-1])
    return loc[:-1] if holder is not None and str(loc[-2]) in holder.model_fields else None


def _pydantic_problem(err: dict) -> Problem:
    loc = tuple(err["loc"])
    field = _union_field(loc)
    if field is not None:  # one problem for the field, not one per member of its type
        kinds = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean"}
        members = typing.get_args(_model_at(field).model_fields[str(field[-1])].annotation)
        want = " or ".join(_member_name(m, kinds) for m in members)
        return Problem(_json_path(field), f"expected {want}, got {_show(err.get('input'))}")
    path = _json_path(loc)
    kind = err["type"]
    got = err.get("input")
    if kind == "extra_forbidden":
        model = _model_at(loc)
        known = sorted(model.model_fields) if model else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return Problem(path, f"unknown key {loc[-1]!r}{hint}", tuple(known))
    if kind == "literal_error" or (kind == "value_error" and _registered_values(_field_at(loc)) is not None):
        return Problem(path, f"{_show(got)} is not a valid value", _allowed_values(loc))
    if kind in ("bool_type", "bool_parsing"):
        return Problem(path, f"expected a JSON boolean, got {_show(got)}", ("true", "false"))
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return Problem(path, f"expected a JSON integer, got {_show(got)}")
    if kind == "greater_than_equal":
        return Problem(path, f"must be >= {err['ctx']['ge']}, got {_show(got)}")
    if kind == "greater_than":
        return Problem(path, f"must be > {err['ctx']['gt']}, got {_show(got)}")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        field = _field_at(loc)
        optional = field is not None and type(None) in typing.get_args(field.annotation)
        return Problem(path, f"expected a JSON object{' or null' if optional else ''}, got {_show(got)}")
    if kind == "list_type":
        return Problem(path, f"expected a JSON list of strings, got {_show(got)}")
    if kind == "string_type":
        return Problem(path, f"expected a JSON string, got {_show(got)}", _allowed_values(loc))
    return Problem(path, err["msg"], _allowed_values(loc))


def _member_name(member: Any, kinds: dict[str, str]) -> str:
    """How one member of a union field reads in an error: "an integer", '"lr_decay"', "null"."""
    if typing.get_origin(member) is typing.Literal:
        return " or ".join(json.dumps(v) for v in typing.get_args(member))
    return kinds.get(getattr(member, "__name__", ""), "null")


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)
