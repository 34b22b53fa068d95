"""torchtitan's activation-checkpointing configurables, running on ``checkpointing``.

torchtitan (0.3.0) takes activation checkpointing as a configurable: its ``Trainer.Config`` has an
``activation_checkpoint`` field holding the ``Config`` of an ``ActivationCheckpointing`` subclass,
and the model's parallelize function calls ``config.build(dump_folder=...).apply(model)``, which
checkpoints every block of ``model.layers``. This module gives configurables of the same shape:

- ``FullAC``: every block recomputed (torchtitan's ``FullAC``, same fields).
- ``SelectiveAC``: torchtitan's "op" policy, the same fields (``force_recompute_mm_shapes_by_fqns``,
  ``get_save_ops`` to override), plus ``selective_ac_option``: ``"op"`` (default) or ``"k"``,
  every k-th block fully recomputed (torchtitan's earlier "layer" mode).
- ``MemoryBudgetAC``: ``memory_budget`` as torchtitan reads it (0: the activations of full
  checkpointing, 1: those of none), planned in eager mode by ``checkpointing.plan_checkpointing``
  on the first training step; torchtitan's own needs ``torch.compile``.
- ``SpecAC``: what a ``checkpointing.apply_spec`` mapping says, per module name.

The blocks keep their names and ``state_dict`` keys (``checkpointing.checkpoint_module``, not a
wrapper), and code inside them that says what to keep (``checkpointing.keep``,
``@checkpointing.keeping()``) is honoured. Importing this module without torchtitan, or with a
release other than the one it was checked against, raises an ``ImportError`` that says what to
install; the budget planning lives in ``_titan_budget``.

NOTE [torchtitan integration]
  Rule 1. Each class subclasses torchtitan's ``ActivationCheckpointing`` (``FullAC`` and
          ``SelectiveAC`` their namesakes, so torchtitan's checks that ask "is this selective?"
          still see it) and its ``Config`` torchtitan's, so a ``Trainer.Config`` takes it where it
          takes theirs. ``MemoryBudgetAC`` does not subclass theirs: the trainer refuses theirs
          without ``torch.compile``, and ours needs none.
  Rule 2. Blocks are ``model.layers``' children, as torchtitan's ``apply`` finds them, in order;
          "every k-th" counts them from 1, as torchtitan's layer mode did (k=2: the 2nd, 4th...).
  Rule 3. Gradients are those of torchtitan's runs (the same op decisions, the same RNG
          handling), and the bytes kept between forward and backward no more than theirs
          (``tests/test_torchtitan.py`` compares both on torchtitan's debug models).
  Rule 4. Options a mode cannot honour are refused when it is applied, not ignored: the
          budget and spec modes install checkpoints whose RNG and determinism settings are the
          defaults, so other values are an error there.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Any, Final

_TESTED: Final = ("0.3.0",)

_MSG_NO_TORCHTITAN = (
    "checkpointing.integrations.torchtitan needs the `torchtitan` package, which is not installed "
    "(importing `checkpointing` itself never needs it). Fix: pip install --no-deps "
    "torchtitan==0.3.0 tyro einops spmd_types==0.2.3 (torchtitan's other dependencies are for its "
    "data loading and logging); in a clone of this repository: pip install --no-deps --group "
    "torchtitan."
)
_MSG_VERSION = (
    "checkpointing.integrations.torchtitan: installed torchtitan is {got}, but this integration "
    "was checked against torchtitan {tested} only (its configurables subclass torchtitan's and "
    "read its model layout, which change between releases). Fix: pip install --no-deps "
    "torchtitan=={newest}, or use checkpointing.checkpoint_module(block, ...) on the blocks "
    "yourself."
)


def _check_release(installed: str | None) -> None:
    """Refuse a torchtitan other than the releases this integration was checked against
    (``installed``: its version, None where it is not installed)."""
    if installed is None:
        raise ImportError(_MSG_NO_TORCHTITAN, name="torchtitan")
    if installed not in _TESTED:
        raise ImportError(
            _MSG_VERSION.format(got=installed, tested=", ".join(_TESTED), newest=_TESTED[-1]),
            name="torchtitan",
        )


try:
    _installed: str | None = importlib.metadata.version("torchtitan")
except importlib.metadata.PackageNotFoundError:
    _installed = None
_check_release(_installed)

# After the checks above: without torchtitan, or with another release, their message comes first.
from torch import nn  # noqa: E402
from torchtitan.distributed import activation_checkpoint as _titan  # noqa: E402

from .._module import checkpoint_module  # noqa: E402
from .._planning import ActivationPlan  # noqa: E402
from .._selective.alternating import TorchtitanOp, torchtitan_save_ops  # noqa: E402
from .._spec import AppliedSpec, apply_spec  # noqa: E402
from .._spec_grammar import budget_key  # noqa: E402
from ..policies import as_context_fn  # noqa: E402
from ._titan_budget import plan_on_first_step  # noqa: E402

__all__ = ["FullAC", "MemoryBudgetAC", "SelectiveAC", "SpecAC"]

_MSG_NO_LAYERS = (
    "checkpointing.integrations.torchtitan.{cls}.apply: expected a torchtitan model whose blocks "
    "are the children of `model.layers`, got {model} without a `layers` submodule. Fix: apply it "
    "to the model torchtitan builds (a decoder), or checkpoint the blocks yourself with "
    "checkpointing.checkpoint_module(block, ...)."
)
_MSG_OPTION = (
    "checkpointing.integrations.torchtitan.SelectiveAC: selective_ac_option must be 'op' or a "
    "positive whole number of blocks as a string (e.g. '2': every 2nd block fully recomputed), "
    "got {got!r}. Fix: selective_ac_option='op' or '2'."
)
_MSG_NOT_LINEAR = (
    "checkpointing.integrations.torchtitan.SelectiveAC: force_recompute_mm_shapes_by_fqns entry "
    "{entry!r} matches {fqn!r}, a {cls}; only nn.Linear modules give a matmul shape to force "
    "recompute of. Fix: name the linear itself (e.g. 'moe.router.gate')."
)
_MSG_BUDGET = (
    "checkpointing.integrations.torchtitan.MemoryBudgetAC: memory_budget must be a number in "
    "[0, 1] (0: what full checkpointing keeps, 1: what no checkpointing keeps), got {got!r}. "
    "Fix: e.g. memory_budget=0.5."
)
_MSG_SPEC_BUDGET = (
    "checkpointing.integrations.torchtitan.SpecAC: the spec key {key!r} has a budget; under "
    "torchtitan the budget is MemoryBudgetAC's, planned with its checks for a sharded model. "
    "Fix: use MemoryBudgetAC(memory_budget=...) for the blocks, or give the key 'full', a "
    "policy or 'none'."
)
_MSG_DEFAULTS = (
    "checkpointing.integrations.torchtitan.{cls}: {name}={got!r} cannot be honoured: this mode "
    "installs checkpoints with the default {name} ({default!r}). Fix: leave {name} at its default, "
    "or use FullAC / SelectiveAC, which take it."
)


def _blocks(model: nn.Module, cls: str) -> list[tuple[str, nn.Module]]:
    """Rule 2: ``model.layers``' children with their names, in order."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.Module):
        raise ValueError(_MSG_NO_LAYERS.format(cls=cls, model=type(model).__name__))
    return list(layers.named_children())


def _whole(block: nn.Module, config: Any) -> nn.Module:
    """``block`` checkpointed in place, all of it recomputed, with the config's options."""
    return checkpoint_module(
        block,
        preserve_rng_state=config.preserve_rng_state,
        determinism_check=config.determinism_check,
        debug=config.debug,
    )


def _check_defaults(config: Any, cls: str) -> None:
    """Rule 4: the inherited options at their defaults."""
    for name, default in (("preserve_rng_state", True), ("determinism_check", "default")):
        got = getattr(config, name)
        if got != default:
            raise ValueError(_MSG_DEFAULTS.format(cls=cls, name=name, got=got, default=default))


# torchtitan ships no type information: its classes are ``Any`` to mypy, hence the ignores.
class FullAC(_titan.FullAC):  # type: ignore[misc]  # subclassing torchtitan's (untyped) class
    """Recompute every block in backward: torchtitan's ``FullAC`` on ``checkpointing``.

    Same fields as torchtitan's (``preserve_rng_state``, ``determinism_check``, ``debug``).
    Put ``FullAC.Config()`` where a torchtitan config takes ``activation_checkpoint``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_titan.FullAC.Config):  # type: ignore[misc]  # torchtitan's (untyped) class
        pass

    def apply(self, model: nn.Module) -> None:
        """Checkpoint every block of ``model.layers`` in place (names unchanged)."""
        for name, block in _blocks(model, "FullAC"):
            self._wrap_block(block, base_fqn=f"layers.{name}")

    def _wrap_block(self, module: nn.Module, *, base_fqn: str | None = None) -> nn.Module:
        return _whole(module, self.config)


class SelectiveAC(_titan.SelectiveAC):  # type: ignore[misc]  # torchtitan's (untyped) class
    """torchtitan's "op" policy per block, or every k-th block fully recomputed.

    Same fields as torchtitan's ``SelectiveAC`` (``force_recompute_mm_shapes_by_fqns``: the
    linears whose matmul shape is always recomputed, default the MoE router's gate), and
    ``selective_ac_option``: ``"op"`` keeps the compute-intensive and communication ops' outputs
    and recomputes every second matmul and the rest (``checkpointing.policies`` name
    ``"torchtitan:op"``); ``"2"`` (any positive whole number k) recomputes every k-th block
    whole and leaves the others alone. Override ``get_save_ops`` to change the kept ops.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_titan.SelectiveAC.Config):  # type: ignore[misc]  # torchtitan's (untyped)
        selective_ac_option: str = "op"
        """``"op"``: the per-op policy in every block; a positive whole number k as a string:
        every k-th block (the k-th, 2k-th, ...) fully recomputed, the others not checkpointed."""

    def get_save_ops(self) -> set[Any]:
        """The ops whose outputs the "op" policy keeps; override to change them."""
        return set(torchtitan_save_ops())

    def apply(self, model: nn.Module) -> None:
        """Checkpoint the blocks of ``model.layers`` in place (names unchanged)."""
        every = _every(self.config.selective_ac_option)
        for index, (name, block) in enumerate(_blocks(model, "SelectiveAC")):
            if every is None:
                self._wrap_block(block, base_fqn=f"layers.{name}")
            elif (index + 1) % every == 0:  # Rule 2
                _whole(block, self.config)

    def _wrap_block(self, module: nn.Module, *, base_fqn: str | None = None) -> nn.Module:
        policy = TorchtitanOp(self._forced_shapes(module, base_fqn), self.get_save_ops())
        return checkpoint_module(
            module,
            context_fn=as_context_fn(policy),
            preserve_rng_state=self.config.preserve_rng_state,
            determinism_check=self.config.determinism_check,
            debug=self.config.debug,
        )

    def _forced_shapes(self, block: nn.Module, base_fqn: str | None) -> set[tuple[int, int]]:
        """The ``(in, out)`` matmul shapes of the block's linears named by
        ``force_recompute_mm_shapes_by_fqns`` (a name matches where it is part of the full one,
        as in torchtitan)."""
        shapes: set[tuple[int, int]] = set()
        for path, module in block.named_modules():
            fqn = f"{base_fqn}.{path}" if base_fqn else path
            entry = next(
                (e for e in self.config.force_recompute_mm_shapes_by_fqns if e in fqn), None
            )
            if entry is None:
                continue
            if not isinstance(module, nn.Linear):
                cls = type(module).__name__
                raise ValueError(_MSG_NOT_LINEAR.format(entry=entry, fqn=fqn, cls=cls))
            out_features, in_features = module.weight.shape
            shapes.add((in_features, out_features))
        return shapes


def _every(option: object) -> int | None:
    """``selective_ac_option`` read: None for ``"op"``, else the positive k of "every k-th"."""
    if option == "op":
        return None
    if isinstance(option, str) and option.isdigit() and int(option) > 0:
        return int(option)
    raise ValueError(_MSG_OPTION.format(got=option))


class MemoryBudgetAC(_titan.ActivationCheckpointing):  # type: ignore[misc]  # untyped base
    """Fit a memory budget without ``torch.compile``: planned by ``checkpointing``'s planner.

    ``memory_budget`` reads as torchtitan's: 0.0 keeps what checkpointing every block keeps,
    1.0 what no checkpointing keeps, a value between them that share of the way. ``apply``
    installs nothing yet (torchtitan applies it to a model on the meta device); the first
    forward in training mode with grad enabled measures one step of the real model on its real
    inputs, plans the blocks of ``model.layers`` (per block: not checkpointed, checkpointed, or
    checkpointed keeping some op outputs) and installs the plan, which then serves every step.
    Under FSDP2 every rank plans and installs rank 0's plan. The plan is logged on the
    ``"checkpointing.torchtitan"`` logger.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_titan.ActivationCheckpointing.Config):  # type: ignore[misc]  # untyped base
        memory_budget: float = 0.5
        """0.0: the activations of full checkpointing; 1.0: those of none; between: that
        share of the way from the first to the second."""

    def apply(self, model: nn.Module) -> None:
        """Plan ``model``'s blocks at its first training step (Rule 4: default options only)."""
        _check_defaults(self.config, "MemoryBudgetAC")
        budget = self.config.memory_budget
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 <= budget <= 1:
            raise ValueError(_MSG_BUDGET.format(got=budget))
        blocks = [block for _, block in _blocks(model, "MemoryBudgetAC")]
        plan_on_first_step(model, blocks, float(budget), self._planned)

    plan: ActivationPlan | None = None
    """The installed plan, once the first training step has made it (``print(ac.plan)``)."""

    def _planned(self, plan: ActivationPlan) -> None:
        self.plan = plan


class SpecAC(_titan.ActivationCheckpointing):  # type: ignore[misc]  # untyped base
    """Checkpoint what a ``checkpointing.apply_spec`` mapping says, by module name.

    ``spec`` maps module-name patterns of the model (``"layers.{::2}"``, ``"layers.*.moe"``)
    to ``"full"``, ``"offload"``, ``"none"``, a policy name (``"torchtitan:op"``,
    ``"save_matmuls"``) or a policy; ``checkpointing.load_spec`` reads one from TOML or YAML.
    A budget value is refused: ``MemoryBudgetAC`` is torchtitan's budget.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_titan.ActivationCheckpointing.Config):  # type: ignore[misc]  # untyped base
        spec: dict[str, Any] = field(default_factory=dict)
        """The mapping ``checkpointing.apply_spec`` takes, its names relative to the model."""

    applied: AppliedSpec | None = None

    def apply(self, model: nn.Module) -> None:
        """``checkpointing.apply_spec(model, spec)``; the result is kept as ``self.applied``."""
        _check_defaults(self.config, "SpecAC")
        key = budget_key(self.config.spec, "integrations.torchtitan.SpecAC")
        if key is not None:
            raise ValueError(_MSG_SPEC_BUDGET.format(key=key))
        self.applied = apply_spec(model, self.config.spec)
