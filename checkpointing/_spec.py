"""``apply_spec``: one declarative mapping says what each module of a model gets.

Owns matching a spec's keys against a model's module names, the overlap rule, the errors for a
key that selects nothing, installing the selection (``checkpoint_module`` per module) and the
printable result, ``AppliedSpec``. The grammar of keys and values belongs to ``_spec_grammar``;
checkpointing a module through hooks to ``_module``; wrappers chosen by a spec to ``_auto_wrap``,
which asks ``select`` here.

NOTE [Spec selection]
  Rule 1. Every key must select at least one module; one that selects none is an error naming
          the module names nearest to it and, where a leading part of the key matches, the
          children found there. A typo never silently checkpoints less.
  Rule 2. A module selected by several keys gets the value of the most specific key (NOTE
          [Spec grammar], Rule 3); equal specificity with different values is an error naming
          both keys and the module. A module reached under two names (a shared module) is one
          module.
  Rule 3. The root is never selected (checkpoint the model around the call instead); a module
          already checkpointed (``checkpoint_module``, a wrapper, a plan) is an error: twice
          would recompute it twice per backward. So is a model with transformers' own
          checkpointing on (a module with ``gradient_checkpointing=True`` and a function).
  Rule 4. A module that gets ``full``, ``offload`` or a policy becomes one checkpointed region
          through ``checkpoint_module`` (names, types and ``state_dict`` keys unchanged).
          Selected modules may nest (a layer and its MLP): nested regions, as nested
          ``checkpoint`` calls give. Each region runs without the empty key/value cache it is
          handed while autograd records (NOTE [Key/value caches]), as transformers' own
          checkpointing does; and while autograd records, a model whose ``forward`` takes
          ``use_cache`` is called with ``use_cache=False`` unless the caller hands it a cache
          (transformers' own checkpointing switches the cache off too). Without that, a
          model's cache would reach a selected layer holding the keys of the layers before it,
          which a region can neither keep (it would be updated twice) nor drop (NOTE [Key/value
          caches], Rule 3).
  Rule 5. ``dry_run=True`` checks and selects exactly as a real call does and installs
          nothing: what it prints is what the real call will install.

NOTE [Spec budget]
  Rule 1. A budget value (``"budget:S"``, NOTE [Spec grammar], Rule 5) has the planner choose, per
          module its key selects, not checkpointed, checkpointed, or checkpointed keeping some op
          outputs. Its regions are the modules whose value it decides by Selection Rule 2: a
          module a more specific key gives another value is not one of them (``"none"``
          included). A budget region may neither lie inside nor hold a module another key
          checkpoints (an error naming both): the plan's choice is made for the module as it
          runs plainly, which a region nested in it, or around it, would change.
  Rule 2. A spec has no example inputs: nothing is planned by ``apply_spec``. The model is
          planned at its first forward with grad enabled (a forward under ``no_grad`` or
          ``inference_mode`` before it leaves everything as it is and runs plainly), on that
          forward's arguments (NOTE [Budget at the first step]); the other keys' regions are
          installed right after the plan, before that forward runs on. So the planner measures
          the model without checkpointing, as it must, and that first forward and every one
          after it runs with the whole spec installed.
  Rule 3. One budget key per spec: two shares would be two budgets over one step, which the
          planner does not divide. A second is an error naming both keys and the fix (one key
          selecting all the modules, or one budget).
  Rule 4. Until the first step the printed result shows ``budget S (planned at first step)``;
          then each budget module's row shows the plan's choice for it, and ``plan`` holds the
          plan. ``remove()`` takes the plan off too, or cancels a planning not yet run.
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import _compat
from ._errors import describe_value
from ._kv_caches import drop_caches, is_cache
from ._module import checkpoint_module, is_module_checkpointed, remove_checkpoint_module
from ._spec_grammar import (
    OFFLOAD_EVERYTHING,
    Action,
    Selector,
    flatten,
    parse_action,
    parse_selector,
)
from ._state import noop_context_fn

if TYPE_CHECKING:  # the planner is imported at the first step only
    from ._planning import ActivationPlan

__all__ = [
    "AppliedSpec",
    "Selected",
    "apply_spec",
    "carries_spec",
    "install",
    "remove_found",
    "select",
    "spec_drops_caches",
]

_MSG_NOTHING = (
    "checkpointing.{api}: the spec key {key!r} selects no module of {model}.{found} Nearest "
    "module names: {near}. Fix: correct the key (globs match one name component; a layer "
    "selector {{0:8}} picks among integer-named children), or remove it."
)
_MSG_FOUND = " {prefix!r} matches {count} module(s), whose children are named {children}."
_MSG_TIE = (
    "checkpointing.{api}: the module {name!r} is selected by {a!r} ({va}) and by {b!r} ({vb}) "
    "with equal specificity {spec} (literal components, layer selectors, globs). Fix: make "
    "one key more specific (a literal name or a layer selector in place of a glob), or give "
    "both the same value."
)
_MSG_ROOT = (
    "checkpointing.{api}: the spec key {key!r} selects the model itself; a spec selects its "
    "submodules. Fix: checkpoint the whole model around its call (checkpointing.checkpoint), "
    "or select its blocks, e.g. 'model.layers.*'."
)
_MSG_ALREADY = (
    "checkpointing.{api}: the module {name!r} ({type}) already checkpoints (checkpoint_module, "
    "a checkpoint wrapper or an applied plan); a second region would recompute it twice per "
    "backward. Fix: remove the first (AppliedSpec.remove(), remove_checkpoint_module, "
    "plan.remove) before applying the spec."
)
_MSG_INDEX = (
    "checkpointing.{api}: the layer index {index} is out of range: the {type} it picks from "
    "has {n} integer-named children (indices 0 to {last}, or -{n} to -1 from the end). Fix: pick "
    "an index in that range, or use a slice, which takes what exists."
)
_MSG_FLAGS = (
    "checkpointing.{api}: transformers' own activation checkpointing is on (the module {name!r} "
    "has gradient_checkpointing=True); the spec's regions would checkpoint inside or around "
    "it, twice. Fix: model.activation_checkpointing_disable() (or "
    "checkpointing.integrations.transformers.disable(model)) first, or pass the spec to "
    "checkpointing.integrations.transformers.enable(model, spec=...)."
)
_MSG_TWO_BUDGETS = (
    "checkpointing.{api}: the spec has two budget keys, {a!r} ({va}) and {b!r} ({vb}); one "
    "step is planned for one budget. Fix: one key selecting all the modules to plan, e.g. "
    "'layers.*': 'budget:0.5', or give the other modules 'full', a policy or 'none'."
)
_MSG_BUDGET_NESTED = (
    "checkpointing.{api}: the module {inner!r} ({vi}, from {ki!r}) lies inside {outer!r} ({vo}, "
    "from {ko!r}); a budget's module is planned as it runs plainly, which a region inside or "
    "around it would change. Fix: a more specific key giving one of the two 'none' or the "
    "other's value, e.g. {{{inner!r}: 'none'}}; or keys that select modules beside the budget's."
)
_MSG_NOT_MODULE = (
    "checkpointing.{api}: expected an nn.Module, got {got}. Fix: pass the model, e.g. "
    "apply_spec(model, spec)."
)


@dataclass(frozen=True)
class Selected:
    """One selected module: its name, its class, what it gets and the key that decided."""

    name: str
    module: nn.Module = field(repr=False, compare=False)
    action: Action
    key: str


@dataclass
class AppliedSpec:
    """What ``apply_spec`` selected (and, unless a dry run, installed): print it to see which
    module got what; ``remove()`` takes it off again."""

    selected: list[Selected]
    modules: int
    dry_run: bool
    plan: ActivationPlan | None = None
    """A budget key's plan, once the first step with grad made it (NOTE [Spec budget])."""
    _handles: list[RemovableHandle] = field(default_factory=list, repr=False)
    _installed: list[nn.Module] = field(default_factory=list, repr=False)
    _model: nn.Module | None = field(default=None, repr=False)

    def actions(self) -> dict[str, str]:
        """Per selected module name, what it gets, as printed (``'full'``, ``'none'``,
        ``'offload'``, the policy's repr, ``'save_matmuls()'``, or a budget's,
        ``'budget 0.5 (planned at first step)'`` and then the plan's choice)."""
        return {s.name: self._shown(s) for s in self.selected}

    def remove(self) -> None:
        """Take the installed regions off: the modules run plainly again."""
        for module in self._installed:
            if is_module_checkpointed(module):
                remove_checkpoint_module(module)
        for handle in self._handles:
            handle.remove()
        if self.plan is not None and self._model is not None:
            self.plan.remove(self._model)
        self._installed.clear()
        self._handles.clear()
        self._model = None

    def _checkpoints(self, item: Selected) -> bool:
        """Whether ``item`` is counted as checkpointed: a budget's module once its plan says so
        (before the plan: to be planned)."""
        if item.action.kind != "budget" or self.plan is None:
            return item.action.kind != "none"
        decided = {r.name: r for r in self.plan.regions}.get(item.name)
        return decided is not None and decided.checkpoint

    def _shown(self, item: Selected) -> str:
        """NOTE [Spec budget], Rule 4: what a row says the module gets."""
        if item.action.kind != "budget":
            return str(item.action)
        if self.plan is None:
            return f"{item.action} (planned at first step)"
        decided = {r.name: r for r in self.plan.regions}.get(item.name)
        if decided is None:  # inside another module of the budget: the plan's region is that one
            return f"{item.action}: inside a planned region"
        return f"{item.action}: {decided.describe()}"

    def __str__(self) -> str:
        shown = [s for s in self.selected if self._checkpoints(s)]
        head = f"apply_spec: {len(shown)} of {self.modules} modules checkpointed" + (
            " (dry run: nothing installed)" if self.dry_run else ""
        )
        width = max((len(s.name) for s in self.selected), default=0)
        kind = max((len(type(s.module).__name__) for s in self.selected), default=0)
        shown_as = [self._shown(s) for s in self.selected]
        gets = max((len(text) for text in shown_as), default=0)
        rows = [
            f"  {s.name:<{width}}  {type(s.module).__name__:<{kind}}  {text:<{gets}}  <- {s.key!r}"
            for s, text in zip(self.selected, shown_as, strict=True)
        ]
        return "\n".join([head, *rows])


def apply_spec(model: nn.Module, spec: Mapping[str, Any], *, dry_run: bool = False) -> AppliedSpec:
    """Give each module of ``model`` what ``spec`` says: full recompute, a policy, offload, or
    nothing; print the result to see which module got what.

    ``spec`` maps module-name patterns to values (a dict, or ``load_spec(text)`` of TOML or
    YAML). A key is a dotted pattern over ``model.named_modules()`` names: literal
    components, globs within one component (``*``), ``**`` for any number of components, and
    layer selectors in braces over integer-named children (``{0:8}``, ``{::2}``, ``{-4:}``,
    ``{0,3,5}``). A value is ``"full"``, ``"offload"`` (nothing recomputed: what the module
    saves is kept in host memory), ``"none"``/``None``, a policy name (``"save_matmuls"``), a
    policy object, or a budget share, ``"budget:0.5"``: the planner chooses what the key's
    modules checkpoint at the model's first forward with grad, keeping that share of the way
    from full recompute of them (0) to keeping all they save (1); one budget key per spec.
    A module selected by several keys gets the most specific key's value (more literal
    components, then more layer selectors, then more globs); a tie is an error, and so is a
    key that selects nothing (the message names the nearest modules).

    Args:
        model: the model; its submodules are selected, never the model itself.
        spec: the mapping; a nested mapping is a table whose keys join the outer one.
        dry_run: select, check and return the result without installing anything.

    Returns:
        An ``AppliedSpec``: ``print(result)``; ``result.actions()``; ``result.remove()``;
        ``result.plan`` (a budget key's plan, after the first step).

    Example:
        >>> import torch, checkpointing
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        >>> print(checkpointing.apply_spec(model, {"{::2}": "full", "{-1}": "save_matmuls"}))
        apply_spec: 3 of 4 modules checkpointed
          0  Linear  full            <- '{::2}'
          2  Linear  full            <- '{::2}'
          3  Linear  save_matmuls()  <- '{-1}'
    """
    chosen = select(model, spec, "apply_spec")
    result = AppliedSpec(chosen, sum(1 for _ in model.modules()) - 1, dry_run)
    if not dry_run:
        install(result, model)
    return result


def install(result: AppliedSpec, model: nn.Module) -> None:
    """Rule 4: each selected module that gets something becomes a region; all or nothing.
    With a budget key (NOTE [Spec budget], Rule 2) the regions wait for the first step."""
    try:
        if _takes_use_cache(model) and any(s.action.kind != "none" for s in result.selected):
            handle = model.register_forward_pre_hook(
                spec_turns_cache_off, with_kwargs=True, prepend=True
            )
            result._handles.append(handle)
        budget = [s for s in result.selected if s.action.kind == "budget"]
        if not budget:
            _install_regions(result)
            return
        from ._planning.first_step import plan_on_first_step  # the planner, when it is needed

        def planned(plan: ActivationPlan) -> None:
            result.plan, result._model = plan, model
            _install_regions(result)

        share = budget[0].action.share
        assert share is not None  # a budget action carries its share
        result._handles.append(
            plan_on_first_step(model, [s.module for s in budget], share, planned, ready=_with_grad)
        )
    except BaseException:
        result.remove()
        raise


def _with_grad(model: nn.Module) -> bool:
    """NOTE [Spec budget], Rule 2: the first forward with grad enabled plans."""
    return torch.is_grad_enabled()


def _install_regions(result: AppliedSpec) -> None:
    """Rule 4: the regions of every key but a budget's (whose plan installs its own)."""
    try:
        for item in result.selected:
            if item.action.kind in ("none", "budget"):
                continue
            policy = OFFLOAD_EVERYTHING if item.action.kind == "offload" else item.action.policy
            context_fn = noop_context_fn if policy is None else policy
            checkpoint_module(item.module, context_fn=context_fn)
            result._installed.append(item.module)
            handle = item.module.register_forward_pre_hook(
                spec_drops_caches, with_kwargs=True, prepend=True
            )
            result._handles.append(handle)
    except BaseException:
        result.remove()
        raise


def spec_drops_caches(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Rule 4: ``drop_caches`` under the spec's own name, by which ``carries_spec`` finds the
    regions a spec installed (on the model or on a copy of it)."""
    return drop_caches(module, args, kwargs)


def spec_turns_cache_off(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Rule 4: the model's call without a key/value cache while autograd records, unless the
    caller hands it one (then the regions drop it, or refuse a filled one)."""
    if not torch.is_grad_enabled() or kwargs.get("use_cache") is False:
        return None
    if any(is_cache(value) for value in (*args, *kwargs.values())):
        return None
    return args, {**kwargs, "use_cache": False}


def _takes_use_cache(model: nn.Module) -> bool:
    """Whether ``model.forward`` has a ``use_cache`` parameter (a transformers model)."""
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature
        return False


def carries_spec(model: nn.Module) -> bool:
    """Whether a spec's regions are installed on ``model`` (or on the model it was copied
    from): a module carries ``spec_drops_caches``."""
    return any(spec_drops_caches in _compat.forward_pre_hooks(m) for m in model.modules())


def remove_found(model: nn.Module) -> None:
    """Take off every region a spec installed on ``model``, found from the model itself."""
    for module in model.modules():
        if spec_turns_cache_off in _compat.forward_pre_hooks(module):
            _compat.remove_forward_hooks(module, spec_turns_cache_off, spec_turns_cache_off)
        if spec_drops_caches in _compat.forward_pre_hooks(module):
            _compat.remove_forward_hooks(module, spec_drops_caches, spec_drops_caches)
            if is_module_checkpointed(module):
                remove_checkpoint_module(module)


def select(model: nn.Module, spec: Mapping[str, Any], api: str) -> list[Selected]:
    """The modules ``spec`` selects, each with its value (Rules 1-3), in the model's order."""
    if not isinstance(model, nn.Module):
        raise TypeError(_MSG_NOT_MODULE.format(api=api, got=describe_value(model)))
    flat = flatten(spec, api)
    entries = [(parse_selector(k, api), parse_action(k, v, api)) for k, v in flat.items()]
    budgets = [(sel, action) for sel, action in entries if action.kind == "budget"]
    if len(budgets) > 1:  # NOTE [Spec budget], Rule 3
        (a, va), (b, vb) = budgets[:2]
        raise ValueError(_MSG_TWO_BUDGETS.format(api=api, a=a.key, va=va, b=b.key, vb=vb))
    best: dict[int, tuple[Selector, Action, str, nn.Module]] = {}
    for selector, action in entries:
        names = list(_matches(model, selector, api))
        if not names:
            raise ValueError(_nothing(model, selector, api))
        for name, module in names:
            if not name:
                raise ValueError(_MSG_ROOT.format(api=api, key=selector.key))
            _keep_most_specific(best, selector, action, name, module, api)
    order = {id(m): i for i, m in enumerate(model.modules())}
    chosen = sorted(best.values(), key=lambda entry: order[id(entry[3])])
    for _, action, name, module in chosen:
        if action.kind != "none" and _already(module):
            raise ValueError(_MSG_ALREADY.format(api=api, name=name, type=type(module).__name__))
    if any(action.kind != "none" for _, action, _, _ in chosen):
        flagged = next((n for n, m in model.named_modules() if _flagged(m)), None)
        if flagged is not None:
            raise ValueError(_MSG_FLAGS.format(api=api, name=flagged))
    result = [Selected(name, module, action, sel.key) for sel, action, name, module in chosen]
    _check_budget_apart(result, api)
    return result


def _check_budget_apart(selected: list[Selected], api: str) -> None:
    """NOTE [Spec budget], Rule 1: no region of another key inside or around a budget's."""
    budget = [s for s in selected if s.action.kind == "budget"]
    others = [s for s in selected if s.action.kind not in ("none", "budget")]
    for planned in budget:
        inside = {id(m) for m in planned.module.modules()}
        for other in others:
            if id(other.module) in inside:
                outer, inner = planned, other
            elif any(m is planned.module for m in other.module.modules()):
                outer, inner = other, planned
            else:
                continue
            raise ValueError(
                _MSG_BUDGET_NESTED.format(
                    api=api,
                    inner=inner.name,
                    vi=inner.action,
                    ki=inner.key,
                    outer=outer.name,
                    vo=outer.action,
                    ko=outer.key,
                )
            )


def _keep_most_specific(
    best: dict[int, tuple[Selector, Action, str, nn.Module]],
    selector: Selector,
    action: Action,
    name: str,
    module: nn.Module,
    api: str,
) -> None:
    """Rule 2: record ``selector``'s value for ``module`` unless a more specific key has it."""
    held = best.get(id(module))
    if held is None or selector.specificity > held[0].specificity:
        best[id(module)] = (selector, action, name, module)
        return
    if selector.specificity == held[0].specificity and action != held[1]:
        raise ValueError(
            _MSG_TIE.format(
                api=api,
                name=held[2],
                a=held[0].key,
                va=held[1],
                b=selector.key,
                vb=action,
                spec=selector.specificity,
            )
        )


def _flagged(module: nn.Module) -> bool:
    """Rule 3: a transformers layer whose own checkpointing is on (its flag, and a function)."""
    return getattr(module, "gradient_checkpointing", False) is True and callable(
        getattr(module, "_gradient_checkpointing_func", None)
    )


def _already(module: nn.Module) -> bool:
    """Rule 3: hooks of ``checkpoint_module`` (ours, a plan's) or a checkpoint wrapper."""
    return is_module_checkpointed(module) or isinstance(
        module, _compat.checkpoint_wrapper.ActivationWrapper
    )


def _matches(model: nn.Module, selector: Selector, api: str) -> Iterator[tuple[str, nn.Module]]:
    """The (name, module) pairs ``selector`` selects, each module once."""
    seen: set[int] = set()
    for name, module in _walk(model, "", selector.parts, api):
        if id(module) not in seen:
            seen.add(id(module))
            yield name, module


def _walk(
    module: nn.Module, prefix: str, parts: tuple[Any, ...], api: str
) -> Iterator[tuple[str, nn.Module]]:
    """NOTE [Spec grammar], Rules 1-2, one component at a time."""
    if not parts:
        yield prefix, module
        return
    head, rest = parts[0], parts[1:]
    if head == "**":
        yield from _walk(module, prefix, rest, api)
        for name, child in module.named_children():
            yield from _walk(child, _join(prefix, name), parts, api)
        return
    if isinstance(head, tuple):
        children = _layers(module, head, api)
    else:
        children = [(n, c) for n, c in module.named_children() if fnmatch.fnmatchcase(n, head)]
    for name, child in children:
        yield from _walk(child, _join(prefix, name), rest, api)


def _layers(
    module: nn.Module, items: tuple[slice | int, ...], api: str
) -> list[tuple[str, nn.Module]]:
    """NOTE [Spec grammar], Rule 2: the integer-named children that ``items`` pick, by
    position in increasing order; an index past the end is an error."""
    numbered = sorted(
        ((int(n), n, c) for n, c in module.named_children() if n.isdigit()),
        key=lambda entry: entry[0],
    )
    if not numbered:
        return []
    picked: dict[int, tuple[str, nn.Module]] = {}
    for item in items:
        if isinstance(item, int):
            if not -len(numbered) <= item < len(numbered):
                count = len(numbered)
                raise IndexError(
                    _MSG_INDEX.format(
                        api=api, index=item, type=type(module).__name__, n=count, last=count - 1
                    )
                )
            chosen = [numbered[item]]
        else:
            chosen = numbered[item]
        for number, name, child in chosen:
            picked[number] = (name, child)
    return [picked[number] for number in sorted(picked)]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _nothing(model: nn.Module, selector: Selector, api: str) -> str:
    """Rule 1: the error for a key that selects nothing."""
    names = [name for name, _ in model.named_modules() if name]
    plain = selector.key.replace("{", "").replace("}", "")
    near = difflib.get_close_matches(plain, names, n=5, cutoff=0.4) or names[:5]
    found = ""
    for cut in range(len(selector.parts) - 1, 0, -1):
        prefix = Selector(".".join(selector.key.split(".")[:cut]), selector.parts[:cut])
        hits = list(_matches(model, prefix, api))
        if hits:
            children = sorted({n for _, m in hits for n, _ in m.named_children()})
            shown = ", ".join(map(repr, children[:12])) or "(none)"
            found = _MSG_FOUND.format(prefix=prefix.key, count=len(hits), children=shown)
            break
    return _MSG_NOTHING.format(
        api=api,
        key=selector.key,
        model=type(model).__name__,
        found=found,
        near=", ".join(map(repr, near)) or "(the model has no submodules)",
    )
