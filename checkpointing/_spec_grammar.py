"""The grammar of a checkpointing spec: its keys (which modules), its values (what they get), and
reading one from TOML or YAML text.

Owns ``Selector`` (a key parsed: module-name components, layer selectors, its specificity),
``Action`` (a value parsed: full recompute, a policy, offload, nothing), ``flatten`` (nested
tables joined into dotted keys) and ``load_spec`` (text or a file, TOML or YAML). Matching keys
against a model, the overlap rule and installing belong to ``_spec``; the policies and their
names to ``checkpointing.policies``.

NOTE [Spec grammar]
  Rule 1. A key is a dotted pattern over the qualified names of ``model.named_modules()``, one
          component per name component. A component is a literal (``layers``), a glob
          (``*``, ``h?``, ``layer_*``: ``fnmatch`` within one component, never across a dot),
          ``**`` (any number of components, none included), or a layer selector in braces
          (``{0:8}``, ``{::2}``, ``{-4:}``, ``{0,3,5}``).
  Rule 2. A layer selector picks among the children of one module whose names are integers
          (the blocks of an ``nn.ModuleList`` or ``nn.Sequential``), by their position in
          increasing order: comma-separated items, each an index (negative counts from the end)
          or a Python slice ``start:stop:step``. So ``{:4}`` is the first four, ``{-4:}`` the
          last four, ``{::2}`` every other one from the first, ``{1::3}`` every third from the
          second. An index past the end is an error; a slice takes what exists, as Python's.
  Rule 3. Specificity, for the overlap rule: a key counts its literal components, then its
          layer selectors, then its globs (``**`` counts nothing); of the keys that select one
          module, the one with the larger count wins, compared in that order. Two keys with
          equal counts selecting one module with different values are an error: no order of
          the mapping decides.
  Rule 4. A value is ``"full"`` (recompute everything), ``"offload"`` (recompute nothing:
          every op output the module saves is kept in host memory), ``"none"`` or ``None``
          (nothing: takes a module out of a broader key), the name of a policy (the one table
          ``checkpointing.policies`` reads, so names added to it work here too), or a policy
          object. A mapping as a value is a nested table: its keys are joined to the outer
          key with a dot (TOML tables and YAML mappings read naturally).
  Rule 5. ``"budget:S"``, S a number from 0 to 1, is a budget share: the planner chooses what the
          key's modules checkpoint, keeping that share of the way from full recompute of them
          (0) to keeping all they save (1), as torchtitan's ``memory_budget`` reads (NOTE
          [Spec budget] in ``_spec`` says when and over which modules it plans). One string,
          not a mapping: a mapping as a value is a nested table.
Rejected: matching by regular expression (dots in module names would need escaping in every
key) and ``a-b`` ranges (``-1`` is an index from the end, and two spellings of a range is one
too many).
"""

from __future__ import annotations

import difflib
import importlib
import pathlib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from ._selective import CheckpointPolicy, Policy, uncalled_factory
from ._selective.readable import _Constant
from .policies import _NAMED, _named

__all__ = [
    "Action",
    "Selector",
    "budget_key",
    "check_spec",
    "flatten",
    "load_spec",
    "parse_action",
    "parse_selector",
]

_WORDS: Final = ("full", "offload", "none")
_BUDGET: Final = "budget:"
_SUFFIXES: Final[dict[str, Literal["toml", "yaml"]]] = {
    ".toml": "toml",
    ".yaml": "yaml",
    ".yml": "yaml",
}

_MSG_NOT_MAPPING = (
    "checkpointing.{api}: expected the spec as a mapping from module-name patterns to what "
    "they get (a dict, or load_spec(text)), got {got}. Fix: e.g. "
    "{{'model.layers.{{0:8}}': 'full'}}."
)
_MSG_KEY_TYPE = (
    "checkpointing.{api}: spec keys are module-name patterns (str), got {got}. Fix: write the "
    "key as a string, e.g. 'model.layers.*'."
)
_MSG_EMPTY_COMPONENT = (
    "checkpointing.{api}: the spec key {key!r} has an empty component (two dots in a row, or a "
    "dot at an end). Fix: one name, glob or {{selector}} between dots, e.g. 'model.layers.*'."
)
_MSG_SELECTOR = (
    "checkpointing.{api}: the layer selector {{{body}}} in the spec key {key!r} is not valid: "
    "{why}. Expected comma-separated indices or Python slices: {{0:8}} (layers 0-7), {{::2}} "
    "(every other), {{:4}} (first four), {{-4:}} (last four), {{0,3,5}}. Fix: rewrite it in "
    "that form."
)
_MSG_BRACES = (
    "checkpointing.{api}: the spec key {key!r} has a brace inside the component {part!r}; a "
    "layer selector is a whole component, e.g. 'model.layers.{{0:8}}.mlp'. Fix: put the "
    "selector between dots."
)
_MSG_ACTION = (
    "checkpointing.{api}: the spec key {key!r} has the unknown value {got!r}{close}. Expected "
    "'full', 'offload', 'none' (or None), 'budget:S' (a share S from 0 to 1), a policy name "
    "({names}) or a policy object. Fix: use one of those, e.g. {{{key!r}: 'full'}}."
)
_MSG_SHARE = (
    "checkpointing.{api}: the spec key {key!r} has the budget {got!r}; expected 'budget:S' with "
    "S a number from 0 (full recompute of the key's modules) to 1 (keep all they save). Fix: "
    "e.g. {{{key!r}: 'budget:0.5'}}."
)
_MSG_ACTION_TYPE = (
    "checkpointing.{api}: the spec key {key!r} has the value {got}; expected 'full', "
    "'offload', 'none', a policy name, a policy object, or a nested table of patterns. "
    "Fix: e.g. {{{key!r}: 'save_matmuls'}}."
)
_MSG_FACTORY = (
    "checkpointing.{api}: the spec key {key!r} has the policy factory {name} itself, which "
    "makes a policy but is not one. Fix: call it, {call}, or give its name, {name!r}."
)
_MSG_FORMAT = (
    "checkpointing.load_spec: format must be 'toml' or 'yaml', got {got!r}{where}. Fix: pass "
    "format='toml' (or 'yaml'), or a path ending in .toml, .yaml or .yml."
)
_MSG_NO_YAML = (
    "checkpointing.load_spec: format='yaml' needs PyYAML, which is not installed. Fix: pip "
    "install pyyaml, or write the spec in TOML (read by the standard library's tomllib)."
)
_MSG_YAML_TOP = (
    "checkpointing.load_spec: the YAML text holds {got}, not a mapping of module-name patterns. "
    "Fix: write one 'pattern: value' line per selection, e.g. \"model.layers.'{{0:8}}': full\"."
)


@dataclass(frozen=True)
class Action:
    """What a selected module gets (Rule 4): ``kind`` and, for a policy, the policy."""

    kind: Literal["full", "offload", "none", "policy", "budget"]
    policy: Policy | None = None
    share: float | None = None
    """Rule 5: a budget's share, 0.0 (full recompute) to 1.0 (keep everything)."""

    def __str__(self) -> str:
        if self.kind == "budget":
            return f"budget {self.share}"
        return repr(self.policy) if self.kind == "policy" else self.kind


@dataclass(frozen=True)
class Selector:
    """A spec key parsed (Rule 1), with its specificity (Rule 3)."""

    key: str
    parts: tuple[str | tuple[slice | int, ...], ...]

    @property
    def specificity(self) -> tuple[int, int, int]:
        """Rule 3: (literal components, layer selectors, globs)."""
        literal = sum(isinstance(p, str) and not _is_glob(p) for p in self.parts)
        selectors = sum(isinstance(p, tuple) for p in self.parts)
        globs = sum(isinstance(p, str) and _is_glob(p) and p != "**" for p in self.parts)
        return literal, selectors, globs


def _is_glob(part: str) -> bool:
    return any(c in part for c in "*?[")


# The policy an ``"offload"`` value runs under: every op's output kept in host memory.
OFFLOAD_EVERYTHING: Final[Policy] = _Constant(CheckpointPolicy.MUST_CPU_OFFLOAD, "offload")


def parse_selector(key: object, api: str) -> Selector:
    """Rules 1-2: ``key`` split into components, each selector parsed."""
    if not isinstance(key, str):
        raise TypeError(_MSG_KEY_TYPE.format(api=api, got=f"{key!r} of type {type(key).__name__}"))
    parts: list[str | tuple[slice | int, ...]] = []
    for part in key.split("."):
        if not part:
            raise ValueError(_MSG_EMPTY_COMPONENT.format(api=api, key=key))
        if part.startswith("{") and part.endswith("}"):
            parts.append(_parse_layers(part[1:-1], key, api))
        elif "{" in part or "}" in part:
            raise ValueError(_MSG_BRACES.format(api=api, key=key, part=part))
        else:
            parts.append(part)
    return Selector(key, tuple(parts))


def _parse_layers(body: str, key: str, api: str) -> tuple[slice | int, ...]:
    """Rule 2: ``0:8``, ``::2``, ``0,3,5`` as slices and indices."""
    items: list[slice | int] = []
    for item in body.split(","):
        item = item.strip()
        try:
            if ":" not in item:
                items.append(int(item))
                continue
            fields = item.split(":")
            if len(fields) > 3:
                raise ValueError("a slice has at most two colons")
            numbers = [int(f) if f.strip() else None for f in fields]
        except ValueError as error:
            why = "an empty item" if not item else f"{item!r} ({error})"
            raise ValueError(_MSG_SELECTOR.format(api=api, key=key, body=body, why=why)) from None
        if len(numbers) == 3 and numbers[2] == 0:
            why = f"{item!r} has step 0"
            raise ValueError(_MSG_SELECTOR.format(api=api, key=key, body=body, why=why))
        items.append(slice(*numbers))
    return tuple(items)


def parse_action(key: str, value: object, api: str) -> Action:
    """Rule 4: ``value`` as an ``Action``; a name is looked up in the policies' one table."""
    if value is None:
        return Action("none")
    if isinstance(value, str):
        if value.startswith(_BUDGET):
            return _budget(key, value, api)
        if value in _WORDS:
            return Action(value)  # type: ignore[arg-type]  # one of the three words, checked
        if value not in _NAMED:
            close = difflib.get_close_matches(value, [*_WORDS, *_NAMED], n=1)
            names = ", ".join(map(repr, sorted(_NAMED)))
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                _MSG_ACTION.format(api=api, key=key, got=value, close=hint, names=names)
            )
        return Action("policy", _named(f"checkpointing.{api}", value))
    factory = uncalled_factory(value)
    if factory is not None:
        name, call = factory
        raise TypeError(_MSG_FACTORY.format(api=api, key=key, name=name, call=call))
    if callable(value) and not isinstance(value, type):
        return Action("policy", value)
    got = f"{value!r} of type {type(value).__name__}"
    raise TypeError(_MSG_ACTION_TYPE.format(api=api, key=key, got=got))


def _budget(key: str, value: str, api: str) -> Action:
    """Rule 5: ``"budget:S"`` as an ``Action``; a share outside [0, 1] is an error."""
    try:
        share = float(value.removeprefix(_BUDGET))
    except ValueError:
        share = float("nan")
    if not 0 <= share <= 1:  # NaN fails too
        raise ValueError(_MSG_SHARE.format(api=api, key=key, got=value))
    return Action("budget", share=share)


def flatten(spec: object, api: str) -> dict[str, object]:
    """Rule 4: nested tables joined into dotted keys (``{'model': {'layers.*': 'full'}}`` is
    ``{'model.layers.*': 'full'}``)."""
    if not isinstance(spec, Mapping):
        got = f"{spec!r} of type {type(spec).__name__}"
        raise TypeError(_MSG_NOT_MAPPING.format(api=api, got=got))
    flat: dict[str, object] = {}
    for key, value in spec.items():
        if not isinstance(key, str):
            got = f"{key!r} of type {type(key).__name__}"
            raise TypeError(_MSG_KEY_TYPE.format(api=api, got=got))
        if isinstance(value, Mapping):
            for inner, leaf in flatten(value, api).items():
                flat[f"{key}.{inner}"] = leaf
        else:
            flat[key] = value
    return flat


def load_spec(
    source: str | pathlib.Path, *, format: Literal["toml", "yaml"] | None = None
) -> dict[str, Any]:
    """A spec read from TOML or YAML: ``source`` is the text, or a path to a file.

    ``format`` defaults to the path's suffix (``.toml``, ``.yaml``, ``.yml``); text needs it
    (``"toml"`` or ``"yaml"``). TOML is read by the standard library; YAML needs PyYAML and is
    refused with the fix when it is missing. Keys holding dots or braces are quoted in TOML
    (``"model.layers.{0:8}" = "full"``); tables nest (``[model.layers]``).

    Example:
        >>> import checkpointing
        >>> checkpointing.load_spec('"layers.{::2}" = "full"', format="toml")
        {'layers.{::2}': 'full'}
    """
    where = ""
    if isinstance(source, pathlib.Path):
        where = f" for {str(source)!r}"
        if format is None:
            format = _SUFFIXES.get(source.suffix.lower())
        source = source.read_text()
    if format == "toml":
        return tomllib.loads(source)
    if format == "yaml":
        return _yaml(source)
    raise ValueError(_MSG_FORMAT.format(got=format, where=where))


def _yaml(text: str) -> dict[str, Any]:
    """YAML text through PyYAML's safe loader, refused with the fix where it is missing."""
    try:
        yaml = importlib.import_module("yaml")
    except ImportError:
        raise ImportError(_MSG_NO_YAML) from None
    loaded = yaml.safe_load(text)
    if not isinstance(loaded, dict):
        raise ValueError(_MSG_YAML_TOP.format(got=f"a {type(loaded).__name__}"))
    return loaded


def budget_key(spec: object, api: str) -> str | None:
    """Rule 5: the first key of ``spec`` whose value is a budget, for the callers that install
    at once and so refuse one (a budget is planned at the model's first step)."""
    for key, value in flatten(spec, api).items():
        if isinstance(value, str) and value.startswith(_BUDGET):
            return key
    return None


def check_spec(spec: object, api: str) -> None:
    """Every key and value of ``spec`` parsed, without a model: the grammar's errors now (for
    callers that meet the model later, such as a ``Trainer`` callback)."""
    for key, value in flatten(spec, api).items():
        parse_selector(key, api)
        parse_action(key, value, api)
