"""The JSON form of an ``ActivationPlan``: its format tag, writing it, reading it back checked.

Reading is strict: every field must have the JSON type ``to_json`` writes, never a coercion
(``"false"`` is not ``false``, ``1`` is not ``true``); counts (bytes, occurrences, dimensions)
are non-negative integers, times non-negative finite numbers, and each region appears once.
A mistake names ``ActivationPlan.from_json``, the field (``regions[2].checkpoint``), what was
expected and what came. The text is accepted as ``str`` or ``bytes``, or already parsed (the
``dict`` ``json.loads`` makes of it, e.g. a plan stored inside a larger JSON config). Extra
keys are ignored. Building the plan's objects, and resolving op names, belong to ``plan``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, Final

from ..._errors import describe_value

__all__ = ["FORMAT", "read", "write"]

FORMAT: Final = "checkpointing.ActivationPlan/1"

_MSG_SOURCE = (
    "checkpointing.ActivationPlan.from_json: expected the JSON text plan.to_json() wrote (a str "
    "or bytes) or the dict json.loads makes of it, got {observed}. Fix: "
    "ActivationPlan.from_json(plan.to_json()), or ActivationPlan.from_json(json.load(file))."
)
_MSG_JSON = (
    "checkpointing.ActivationPlan.from_json: {why}. Fix: pass the text plan.to_json() wrote."
)
_MSG_FIELD = (
    "checkpointing.ActivationPlan.from_json: field {field} must be {expected}, got {observed}. "
    "Fix: pass the text plan.to_json() wrote, or correct that field."
)
_MSG_MISSING = (
    "checkpointing.ActivationPlan.from_json: field {field} is missing. Fix: pass the text "
    "plan.to_json() wrote, or add that field."
)
_MSG_JOINED = (
    "checkpointing.ActivationPlan.from_json: regions[{index}] ({name!r}) is joined to the region "
    "before it, so both must be checkpointed whole (checkpoint true; save, offload and skip "
    "empty; keep_draws false), the one before joined or first in its chain; {why}. Fix: pass "
    "the text plan.to_json() wrote, or set regions[{index}].joined to false."
)
_MSG_REGION_TWICE = (
    "checkpointing.ActivationPlan.from_json: region {name!r} appears twice (regions[{first}] "
    "and regions[{second}]); applying the plan would checkpoint that module twice. Fix: keep "
    "one decision per region."
)

# A check reads one field (the value, and where it is, for the message) into what the plan holds.
_Check = Callable[[object, str], Any]


def write(fields: dict[str, Any]) -> str:
    """The plan's ``fields`` as JSON text, after the format tag."""
    return json.dumps({"format": FORMAT, **fields}, indent=1)


def read(source: object) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The plan's fields and its regions' fields from ``source``, every one checked."""
    if isinstance(source, str | bytes | bytearray):
        try:
            data = json.loads(source)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(_MSG_JSON.format(why=f"not JSON ({error})")) from None
    elif isinstance(source, dict):
        data = source
    else:
        raise TypeError(_MSG_SOURCE.format(observed=describe_value(source)))
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(_MSG_JSON.format(why=f"not a plan (expected format {FORMAT!r})"))
    fields = _object(_PLAN, _PLAN_LATER)(data, "")
    regions = fields.pop("regions")
    seen: dict[str, int] = {}
    for index, region in enumerate(regions):
        first = seen.setdefault(region["name"], index)
        if first != index:
            raise ValueError(
                _MSG_REGION_TWICE.format(name=region["name"], first=first, second=index)
            )
        if region["joined"]:
            _check_joined(regions, index)
    return fields, regions


def _check_joined(regions: list[dict[str, Any]], index: int) -> None:
    """Rule S9: a joined region and the one before it are checkpointed whole."""
    name = regions[index]["name"]
    if index == 0:
        raise ValueError(_MSG_JOINED.format(index=0, name=name, why="it is the first region"))
    for position in (index - 1, index):
        region = regions[position]
        whole = region["checkpoint"] and not (
            region["save"] or region["offload"] or region["skip"] or region["keep_draws"]
        )
        if not whole:
            why = f"regions[{position}] ({region['name']!r}) is not"
            raise ValueError(_MSG_JOINED.format(index=index, name=name, why=why))


def _bad(field: str, expected: str, value: object) -> ValueError:
    return ValueError(
        _MSG_FIELD.format(field=field, expected=expected, observed=describe_value(value))
    )


def _count(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(field, "a non-negative integer", value)
    return value


def _number(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(field, "a non-negative number", value)
    if not 0 <= value < math.inf:
        raise _bad(field, "a non-negative number", value)
    return float(value)


def _text(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise _bad(field, "a string", value)
    return value


def _flag(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(field, "true or false (a JSON boolean, not a string or number)", value)
    return value


def _list(item: _Check) -> _Check:
    def check(value: object, field: str) -> list[Any]:
        if not isinstance(value, list):
            raise _bad(field, "a list", value)
        return [item(element, f"{field}[{index}]") for index, element in enumerate(value)]

    return check


def _pair(first: _Check, second: _Check, expected: str) -> _Check:
    def check(value: object, field: str) -> tuple[Any, Any]:
        if not isinstance(value, list) or len(value) != 2:
            raise _bad(field, expected, value)
        return first(value[0], f"{field}[0]"), second(value[1], f"{field}[1]")

    return check


def _keys(value: object, field: str) -> tuple[tuple[str, int], ...]:
    return tuple(_list(_pair(_text, _count, "an [op name, occurrence] pair"))(value, field))


def _object(
    schema: dict[str, _Check], later: dict[str, tuple[_Check, Any]] | None = None
) -> _Check:
    """Every field of ``schema`` checked; those of ``later`` (added to the format since its
    first plans) checked where present, else their defaults."""

    def check(value: object, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _bad(field or "(the plan)", "a JSON object", value)
        read: dict[str, Any] = {}
        for key, item in schema.items():
            where = f"{field}.{key}" if field else key
            if key not in value:
                raise ValueError(_MSG_MISSING.format(field=where))
            read[key] = item(value[key], where)
        for key, (item, default) in (later or {}).items():
            where = f"{field}.{key}" if field else key
            read[key] = item(value[key], where) if key in value else default
        return read

    return check


_REGION: Final[dict[str, _Check]] = {
    "name": _text,
    "type_name": _text,
    "checkpoint": _flag,
    "save": _keys,
    "offload": _keys,
    "ops": _count,
    "kept_bytes": _count,
    "recompute_ms": _number,
}
# Fields added after the format's first plans: read where present, else these defaults.
_REGION_LATER: Final[dict[str, tuple[_Check, Any]]] = {
    "recompute_flops": (_count, 0),
    "keep_draws": (_flag, False),
    "skip": (_keys, ()),
    "draws": (_flag, True),  # unknown: drawing, so the RNG state is kept (Rule A3)
    "joined": (_flag, False),  # Rule S9: one frame with the region before it
}
_SPAN: Final[dict[str, _Check]] = {
    "kind": _text,
    "first": _text,
    "last": _text,
    "recompute_ms": _number,
    "recompute_flops": _count,
}
_PLAN: Final[dict[str, _Check]] = {
    "budget_bytes": _count,
    "baseline_bytes": _count,
    "floor_bytes": _count,
    "outside_bytes": _count,
    "kept_bytes": _count,
    "recompute_ms": _number,
    "step_ms": _number,
    "solver": _text,
    "device": _text,
    "input_shapes": _list(_list(_count)),
    "frontier": _list(_pair(_count, _number, "a [bytes, ms] pair")),
    "regions": _list(_object(_REGION, _REGION_LATER)),
}
_COSTS: Final[dict[str, _Check]] = {
    "name": _text,
    "flops_per_second": _number,
    "float32_flops_per_second": _number,
    "bytes_per_second": _number,
    "dispatch_seconds": _number,
    "policy_seconds_per_op": _number,
    "frame_seconds_per_op": _number,
    "span_call_seconds": _number,
}
_COSTS_LATER: Final[dict[str, tuple[_Check, Any]]] = {
    "random_seconds_per_element": (_number, 0.0),
}
_PLAN_LATER: Final[dict[str, tuple[_Check, Any]]] = {
    "grid_bytes": (_count, 0),
    "objective": (_text, "time"),
    "recompute_flops": (_count, 0),
    "peak_bytes": (_count, 0),
    "spans": (_list(_object(_SPAN)), []),
    "cost": (_number, 0.0),
    # The cost model's constants, named (None: not written).
    "costs": (_object(_COSTS, _COSTS_LATER), None),
}
