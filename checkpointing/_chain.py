"""One non-reentrant checkpoint frame across consecutive module calls: ``checkpoint_chain``.

Owns the hooks that make the calls of several modules, which a root module's forward makes one
after the other (``model.layers[2:5]``), into one region: one frame of ``_frame`` (first
``next()`` at the first module's start, second at the last module's end), the recipe its
recompute re-runs, the pause between two calls and where a chain breaks. The frame itself
(holders, recompute, checks, RNG) belongs to ``_frame``; one module's region to ``_module``.
What ``torch.utils.checkpoint.checkpoint_sequential`` does with segments of several blocks, on
module hooks: one input and one RNG state kept per chain, the blocks' boundaries nowhere.

NOTE [Checkpoint chains]
  Rule 1. One frame per chain: the first member's pre-hook starts ``frame_generator`` with that
          call's arguments as the frame's inputs, the next member continues the same frame, and
          the last member's forward hook ends it. So the frame keeps one input (and one RNG
          state) for the whole chain, as a ``checkpoint_sequential`` segment does: the output of
          block k, which is block k+1's input, is kept nowhere.
  Rule 2. The recipe: the recompute re-runs the recorded calls in order. In a later call's
          arguments, a tensor that *is* (identity) a tensor of an earlier chained call's output
          (in tuples, lists and dicts) is recorded by its place and taken from the re-run's
          output at the same place; every other tensor (an attention mask, rotary embeddings)
          is a constant held by plain reference until backward, as the frame's keyword inputs
          are (NOTE [Nestable checkpoint], Rule 11; a watching report is told). The outputs
          are held weakly, and only while the chain's forward runs: a boundary the root drops
          is freed in forward as without the chain (a tensor that died is no later call's
          argument, so its place is never needed).
  Rule 3. Between two calls the frame is paused: its saved-tensors hook pair leaves the stack
          (the user's hooks below it, if any, are then the top: code the root runs there saves
          as it would without checkpointing) and a dispatch mode watches the gap. The next
          member's pre-hook puts the pair back. The chain continues only if no op ran in the
          gap, the member now starting is the next one, grad is on, the hook stack's top is as
          the pause left it and the root call is the same; else it breaks there: the open
          frame ends (its recipe stops at the last completed call) and a new frame starts at
          the member now starting, so the rest still checkpoints. Reason: an op in the gap is
          in no recipe, and a random draw there would shift the RNG stream the recompute
          replays. A break costs bytes, never correctness. The forward context (from
          ``context_fn``) stays entered across a pause: it sees gap ops only where the chain
          then breaks, after the recipe's last call, where its replay never reaches.
  Rule 4. The stacks are left as found. A member that ends with an exception (its forward
          hook is ``always_call=True`` and gets no output) or returns None ends the frame
          instead of pausing it; the root's forward hook (``always_call=True``) ends a frame
          still paused (the root returned before the last member: an early exit, or an
          exception). A member called outside its root's forward is a frame of its own. Where
          the gap left a dispatch mode of its own on (so the watch is not the innermost mode),
          the member starting runs plainly (no checkpoint) and the chain stays paused until the
          watch is innermost again; the root returning with such a mode still on raises.
  Rule 5. State is per thread, as in NOTE [Module checkpoint hooks], Rule 2: a chain paused in
          one thread is not continued by another, which starts its own frame. A member called
          inside a running member of the same chain is part of that call.
  Rule 6. While the recipe re-runs, the chain's hooks are off in that thread (NOTE [Module
          checkpoint hooks], Rule 3); checkpoints met inside the members still apply.
  Rule 7. Under ``torch.compile`` each member is its own torch region, as ``checkpoint_module``
          makes it (NOTE [Module checkpoint hooks], Rule 6; the hooks return at once while
          dynamo traces): correct, and one boundary per member kept more than eagerly.
  Rule 8. No grad (``torch.no_grad``, inference mode): no frame, nothing recorded.
  Rule 9. The hooks hold no module: each member's knows its place, a recipe holds the modules
          it met. So a chained model deep-copies and pickles with its chains, and the hooks
          are found through themselves (``is_module_chained``, ``unchain_found``).
  Rule 10. The planner may end a chain's region early, at the start of a child its last member
          calls last (``end_chain_at``, as NOTE [Module checkpoint hooks], Rule 7 for one
          module): the child's pre-hook, bound to the last member's hooks, ends the frame open
          there, and the recipe's re-run stops at the same place. Only the last member may end
          early: an earlier member's child would cut the chain's later calls out of the frame.

Rejected: pushing the user's hooks (or an identity pair) over the frame's for the pause. Taking
the frame's pair off saves the gap's tensors the same way, and a gap that pushes hooks of its
own (``with save_on_cpu(): layer(h)`` in the root's loop) keeps a stack whose pops match its
pushes. A dispatch mode that watches the whole chain's forward, not only the gaps: it would see
every op of every member (a Python call each), where the gaps of a model's loop run none.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any, Final

import torch
from torch import nn

from . import _compat, _compiled
from ._context_fn import ContextFnOrPolicy, context_fn_from
from ._determinism import metadata_fn_for
from ._errors import describe_value, internal_error
from ._events import announce_kept, listener
from ._frame import frame_generator, stop_recompute
from ._module import _CheckpointedForward, _ModuleCheckpoint, is_module_checkpointed
from ._options import CheckpointOptions, options_of
from ._regions import region_label
from ._state import noop_context_fn, state_hooks_from

__all__ = [
    "ChainHandle",
    "chain_constants",
    "checkpoint_chain",
    "end_chain_at",
    "is_module_chained",
    "unchain_found",
]

_API: Final = "checkpointing.checkpoint_chain"
_MSG_TOO_FEW = (
    "checkpointing.checkpoint_chain: expected at least 2 modules, got {count}. A chain of one "
    "module is a plain checkpoint. Fix: use checkpoint_module(module) for one module."
)
_MSG_NOT_MODULE = (
    "checkpointing.checkpoint_chain: expected nn.Modules, got {got} at {where}. Fix: pass the "
    "modules themselves, e.g. checkpoint_chain(model.layers[2:5], model)."
)
_MSG_TWICE = (
    "checkpointing.checkpoint_chain: module {index} ({type_name}) {problem}. Fix: chain each "
    "module once, outside other checkpoints of it, and never the root itself."
)
_MSG_MODE_LEFT_ON = (
    "checkpointing.checkpoint_chain: {type_name}'s forward returned with a dispatch mode still "
    "on that it entered between two chained modules, so the chain's paused frame cannot leave "
    "the mode stack as it found it. Fix: leave such modes (a `with` block) before the root's "
    "forward returns."
)
_MSG_REMOVE_IN_FORWARD = (
    "checkpointing.ChainHandle.remove: called while the chain's frame is open (inside the root's "
    "forward). Fix: remove the chain between steps."
)


class _GapWatch(_compat.TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
    """Rule 3: entered at a pause and left at the resume; records whether any op ran."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # untyped in torch
        self.ran = False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.ran = True
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass(frozen=True, slots=True)
class _Slot:
    """Rule 2: where a later call's argument comes from: tensor ``leaf`` of call ``call``'s
    output."""

    call: int
    leaf: int


def _leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of an output, in tuples, lists and dicts (a ``ModelOutput`` too), in order:
    the same walk for the forward's output and the re-run's (Rule 2)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in _leaves(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    return []


def _rebuilt(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with ``leaf`` applied to every leaf; plain tuples, lists and dicts are rebuilt
    only where something inside changed."""
    kind = type(value)
    if kind is tuple or kind is list:
        items = [_rebuilt(item, leaf) for item in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else kind(items)
    if kind is dict:
        mapped = {key: _rebuilt(item, leaf) for key, item in value.items()}
        return value if all(mapped[k] is v for k, v in value.items()) else mapped
    return leaf(value)


def _template(value: Any, found: dict[int, _Slot]) -> Any:
    """``value`` with each tensor in ``found`` (by id) replaced by its slot."""
    return _rebuilt(value, lambda v: found.get(id(v), v) if isinstance(v, torch.Tensor) else v)


def _filled(value: Any, outputs: list[list[torch.Tensor]]) -> Any:
    """``_template``'s inverse at recompute: each slot replaced by the re-run's tensor."""
    return _rebuilt(value, lambda v: outputs[v.call][v.leaf] if isinstance(v, _Slot) else v)


def _constants(value: Any) -> list[torch.Tensor]:
    """The tensors a template holds (Rule 2), for a watching report."""
    if isinstance(value, torch.Tensor):
        return [value]
    if type(value) in (tuple, list):
        return [t for item in value for t in _constants(item)]
    if type(value) is dict:
        return [t for item in value.values() for t in _constants(item)]
    return []


class _Recipe:
    """What the chain's frame re-runs (Rule 2): the first member with the frame's inputs, then
    each recorded call with its slots filled; the chain's hooks off meanwhile (Rule 6)."""

    __slots__ = ("calls", "chain", "first")

    def __init__(self, chain: _Chain, first: nn.Module) -> None:
        self.chain = chain
        self.first = first
        self.calls: list[tuple[nn.Module, Any, Any]] = []  # (module, args, kwargs) templates

    @property
    def region_module(self) -> nn.Module:
        """The chain's region is named after its first member (NOTE [Region names], Rule 1)."""
        return self.first

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        recomputing = self.chain.recomputing
        thread = threading.get_ident()
        recomputing[thread] = recomputing.get(thread, 0) + 1
        try:
            output = self.first(*args, **kwargs)
            outputs = [_leaves(output)]
            for module, args_template, kwargs_template in self.calls:
                output = module(
                    *_filled(args_template, outputs), **_filled(kwargs_template, outputs)
                )
                outputs.append(_leaves(output))
            return output
        finally:
            depth = recomputing.pop(thread)
            if depth > 1:
                recomputing[thread] = depth - 1


def _same_pair(a: _compat.HookPair | None, b: _compat.HookPair | None) -> bool:
    if a is None or b is None:
        return a is b
    return a[0] is b[0] and a[1] is b[1]


class _Open:
    """A chain's frame open in one thread: running a member, or paused between two (Rule 3)."""

    __slots__ = ("below", "depth", "gen", "index", "nested", "outputs", "pair", "recipe", "watch")

    def __init__(
        self,
        gen: Generator[None, None, None],
        recipe: _Recipe,
        pair: _compat.HookPair | None,
        index: int,
        depth: int,
    ) -> None:
        self.gen = gen
        self.recipe = recipe
        self.pair = pair  # the frame's saved-tensors hooks
        self.index = index  # the member running, or the last that completed
        self.depth = depth  # the root's call depth when it opened (Rule 4)
        self.outputs: list[list[weakref.ref[torch.Tensor]]] = []  # per completed call (Rule 2)
        self.nested = 0  # Rule 5: calls of members inside the running member
        self.watch: _GapWatch | None = None  # while paused
        self.below: _compat.HookPair | None = None  # the stack's top while paused


class _Chain:
    """The state every hook of one chain shares: its options and what is open per thread."""

    __slots__ = ("count", "depth", "open", "options", "recomputing")

    def __init__(self, count: int, options: CheckpointOptions) -> None:
        self.count = count
        self.options = options
        self.open: dict[int, _Open] = {}
        self.depth: dict[int, int] = {}  # thread -> root calls running (Rule 4)
        self.recomputing: dict[int, int] = {}  # thread -> recipe re-runs running (Rule 6)

    @_compat.skip_dynamo_in_code  # pushes saved-tensor hooks and modes: never traced
    def start(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: Any) -> None:
        """A member's pre-hook: continue the open frame, or break it and open another."""
        thread = threading.get_ident()
        if self.recomputing.get(thread):
            return  # Rule 6
        current = self.open.get(thread)
        if current is not None:
            if current.watch is None:
                current.nested += 1  # Rule 5
                return
            if _compat.top_dispatch_mode() is not current.watch:
                return  # Rule 4: the gap left a mode on: this call runs plainly
            if self._resume(current, index):
                found = {
                    id(leaf): _Slot(call, i)
                    for call, refs in enumerate(current.outputs)
                    for i, ref in enumerate(refs)
                    if (leaf := ref()) is not None
                }
                call = (module, _template(args, found), _template(kwargs, found))
                current.recipe.calls.append(call)
                current.index = index
                _announce_constants(current.recipe, call)
                return
            self._close(thread, current)
        if torch.is_grad_enabled():  # Rule 8
            recipe = _Recipe(self, module)
            gen = frame_generator(recipe, args, dict(kwargs), self.options)
            next(gen)
            pair = _compat.top_saved_tensors_hooks()
            self.open[thread] = _Open(gen, recipe, pair, index, self.depth.get(thread, 0))

    def _resume(self, current: _Open, index: int) -> bool:
        """Rule 3: end the pause (the watch off, the frame's pair back); whether the chain
        continues with member ``index``."""
        watch = current.watch
        if watch is None:
            internal_error("a chain resumed without a pause")
        watch.__exit__(None, None, None)  # type: ignore[no-untyped-call]  # untyped in torch
        current.watch = None
        clean = not watch.ran and _same_pair(_compat.top_saved_tensors_hooks(), current.below)
        if current.pair is not None:
            _compat.push_saved_tensors_hooks(*current.pair)
        thread = threading.get_ident()
        return (
            clean
            and index == current.index + 1
            and torch.is_grad_enabled()
            and self.depth.get(thread, 0) == current.depth
        )

    @_compat.skip_dynamo_in_code
    def end(self, index: int, output: Any) -> None:
        """A member's forward hook: pause the frame, or end it (the last member, Rule 4)."""
        thread = threading.get_ident()
        if self.recomputing.get(thread):
            return  # Rule 6
        current = self.open.get(thread)
        if current is None or current.watch is not None:
            return  # not ours: a call that ran plainly, or its pre-hook never ran
        if current.nested:
            current.nested -= 1  # Rule 5: a call inside the running member ended
            return
        if current.index != index:
            return  # its pre-hook never ran (an earlier pre-hook raised)
        if (
            index == self.count - 1
            or output is None  # an exception, or nothing to chain
            or current.depth == 0  # called outside the root's forward
            or not _same_pair(_compat.top_saved_tensors_hooks(), current.pair)
        ):
            self._close(thread, current)
            return
        current.outputs.append([weakref.ref(leaf) for leaf in _leaves(output)])
        if current.pair is not None:
            _compat.pop_saved_tensors_hooks()
        current.below = _compat.top_saved_tensors_hooks()
        watch = _GapWatch()
        watch.__enter__()  # type: ignore[no-untyped-call]  # untyped in torch
        current.watch = watch

    @_compat.skip_dynamo_in_code
    def end_early(self, index: int) -> None:
        """Rule 10: the pre-hook of a child of the last member: end the frame here."""
        thread = threading.get_ident()
        if self.recomputing.get(thread):
            stop_recompute()  # the re-run ends where the forward's frame ended
        current = self.open.get(thread)
        if current is None or current.watch is not None or current.index != index:
            return  # not ours: a call that ran plainly or under no grad
        if not current.nested:
            self._close(thread, current)

    def _close(self, thread: int, current: _Open) -> None:
        """End the open frame (Rules 3 and 4): the recipe stops at the last completed call."""
        del self.open[thread]
        if current.watch is not None:
            self._resume(current, -1)
        current.outputs.clear()
        for _ in current.gen:
            internal_error("the frame generator yielded twice")

    def root_started(self) -> None:
        thread = threading.get_ident()
        self.depth[thread] = self.depth.get(thread, 0) + 1

    @_compat.skip_dynamo_in_code
    def root_ended(self, root: nn.Module) -> None:
        """Rule 4: the root returned (or raised): end a frame it left paused."""
        thread = threading.get_ident()
        depth = self.depth.get(thread, 0)
        if depth == 0:
            return
        if depth == 1:
            del self.depth[thread]
        else:
            self.depth[thread] = depth - 1
        current = self.open.get(thread)
        if current is None or current.depth != depth or current.watch is None:
            return
        if _compat.top_dispatch_mode() is not current.watch:
            raise RuntimeError(_MSG_MODE_LEFT_ON.format(type_name=type(root).__name__))
        self._close(thread, current)


def chain_constants(fn: object) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rule 2: the tensors a chain's recipe holds (``fn``: a frame's function), positional
    and keyword; none for any other function. For the report of a graph."""
    if not isinstance(fn, _Recipe):
        return [], []
    positional = [t for _, args, _ in fn.calls for t in _constants(args)]
    return positional, [t for _, _, kwargs in fn.calls for t in _constants(kwargs)]


def _announce_constants(recipe: _Recipe, call: tuple[nn.Module, Any, Any]) -> None:
    """Rule 2: tell a watching report of the tensors a recorded call holds."""
    if listener.get() is None:
        return
    region = region_label(recipe)
    for tensor in _constants(call[1]):
        announce_kept(tensor, region, "nested input")
    for tensor in _constants(call[2]):
        announce_kept(tensor, region, "keyword input")


class _Member:
    """The hooks on one chained module: it knows its place, not the module (Rule 9)."""

    __slots__ = ("chain", "index")

    def __init__(self, chain: _Chain, index: int) -> None:
        self.chain = chain
        self.index = index

    def pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _compiled.compiling():
            return  # Rule 7
        self.chain.start(self.index, module, args, kwargs)

    def forward_hook(self, _module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        if _compiled.compiling():
            return  # Rule 7
        self.chain.end(self.index, output)

    def end_early(self, *_hook_args: object) -> None:
        if _compiled.compiling():
            return  # Rule 7
        self.chain.end_early(self.index)


class _Root:
    """The hooks on the root: its call depth per thread, and the end of a paused frame."""

    __slots__ = ("chain",)

    def __init__(self, chain: _Chain) -> None:
        self.chain = chain

    def pre_hook(self, _module: nn.Module, _args: tuple[Any, ...]) -> None:
        if _compiled.compiling():
            return  # Rule 7
        self.chain.root_started()

    def forward_hook(self, module: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
        if _compiled.compiling():
            return  # Rule 7
        self.chain.root_ended(module)


def _hooks_of(module: nn.Module) -> list[_Member | _Root]:
    """The chain hooks on ``module``, found through the hooks themselves (Rule 9)."""
    found: list[_Member | _Root] = []
    for hook in _compat.forward_pre_hooks(module):
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, (_Member, _Root)):
            found.append(owner)
    return found


def is_module_chained(module: nn.Module) -> bool:
    """Whether ``module`` is a member of a chain (``checkpoint_chain``)."""
    return any(isinstance(owner, _Member) for owner in _hooks_of(module))


def unchain_found(modules: Iterable[nn.Module], root: nn.Module) -> None:
    """Rule 9: the hooks of every chain found on ``modules`` off them (each member's forward put
    back, Rule 7), and those chains' hooks off ``root``; where the handle is not at hand (a copy
    of a chained model) as where it is."""
    chains: set[int] = set()
    for module in modules:
        for owner in _hooks_of(module):
            if not isinstance(owner, _Member):
                continue
            chains.add(id(owner.chain))
            _compat.remove_forward_hooks(module, owner.pre_hook, owner.forward_hook)
            forward = module.__dict__.get("forward")
            if isinstance(forward, _CheckpointedForward):
                if forward.own is None:
                    del module.forward
                else:
                    module.forward = forward.own
    for owner in _hooks_of(root):
        if isinstance(owner, _Root) and id(owner.chain) in chains:
            _compat.remove_forward_hooks(root, owner.pre_hook, owner.forward_hook)


def end_chain_at(module: nn.Module, child: nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Rule 10: end the region of the chain whose last member is ``module`` at the start of
    ``child``, a module it calls last; the handle removes the hook. For the planner."""
    member = next((o for o in _hooks_of(module) if isinstance(o, _Member)), None)
    if member is None or member.index != member.chain.count - 1:
        internal_error("end_chain_at on a module that is not the last of a chain")
    return child.register_forward_pre_hook(member.end_early, prepend=True)


class ChainHandle:
    """What ``checkpoint_chain`` installed; ``remove()`` takes every hook off."""

    __slots__ = ("_chain", "modules", "root")

    def __init__(self, chain: _Chain, modules: list[nn.Module], root: nn.Module) -> None:
        self._chain = chain
        self.modules = modules
        self.root = root

    def remove(self) -> None:
        """Take the chain's hooks off its members and root; graphs built keep working."""
        if self._chain.open:
            raise RuntimeError(_MSG_REMOVE_IN_FORWARD)
        unchain_found(self.modules, self.root)


def checkpoint_chain(
    modules: Sequence[nn.Module],
    root: nn.Module,
    *,
    context_fn: ContextFnOrPolicy = noop_context_fn,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    recompute_state_hooks: object = None,
) -> ChainHandle:
    """Checkpoint consecutive calls of ``modules`` (made by ``root``'s forward, in this order)
    as one non-reentrant region: one input and one RNG state kept for all of them (NOTE
    [Checkpoint chains]). The options are ``checkpoint_module``'s."""
    members = list(modules)
    if len(members) < 2:
        raise ValueError(_MSG_TOO_FEW.format(count=len(members)))
    for where, module in [*enumerate(members), ("root", root)]:
        if not isinstance(module, nn.Module):
            raise TypeError(_MSG_NOT_MODULE.format(got=describe_value(module), where=where))
    seen: set[int] = {id(root)}
    for index, module in enumerate(members):
        problem = (
            "is listed twice, or is the root"
            if id(module) in seen
            else "is checkpointed already"
            if is_module_checkpointed(module) or is_module_chained(module)
            else None
        )
        if problem is not None:
            raise ValueError(
                _MSG_TWICE.format(index=index, type_name=type(module).__name__, problem=problem)
            )
        seen.add(id(module))
    context_fn = context_fn_from(context_fn, _API)
    metadata_fn_for(determinism_check)  # a bad value raises its ValueError now
    options = options_of(
        False,
        preserve_rng_state,
        context_fn,
        determinism_check,
        debug,
        early_stop,
        respect_saved_tensors_hooks,
        recompute_state_hooks,
        api=_API,
    )
    hooks = state_hooks_from(recompute_state_hooks, _API)
    options = dataclasses.replace(options, recompute_state_hooks=hooks)
    chain = _Chain(len(members), options)
    traced = _ModuleCheckpoint(options)  # Rule 7: what torch's region per member gets
    for index, module in enumerate(members):
        member = _Member(chain, index)
        module.register_forward_pre_hook(member.pre_hook, with_kwargs=True)
        module.register_forward_hook(member.forward_hook, prepend=True, always_call=True)
        module.forward = _CheckpointedForward(module, module.__dict__.get("forward"), traced)
    head = _Root(chain)
    root.register_forward_pre_hook(head.pre_hook, prepend=True)
    root.register_forward_hook(head.forward_hook, prepend=True, always_call=True)
    return ChainHandle(chain, members, root)
