"""Ready-made selective-checkpoint policies that read as sentences, and two ways to combine them.

A policy is any callable ``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool`` (the
``Policy`` protocol); ``as_context_fn(policy)`` turns one into the ``context_fn`` of
``checkpointing.checkpoint`` (or of ``torch.utils.checkpoint.checkpoint``, which accepts our
contexts too). The policies here are plain callables, so they also work with
``create_selective_checkpoint_contexts`` directly, ours or torch's. The factories that make them
are not policies: passing one uncalled (``save_matmuls`` for ``save_matmuls()``) is a
``TypeError`` wherever ours takes a policy. All but the name-based ones
answer by op alone and say so with ``answer_for_op(op)``; our selective checkpointing then asks
them once per op overload instead of once per op call (so does ``either``/``both`` of such
policies; a combination with a name-based policy or a plain function is asked per call).

Conventions, so that combinations are predictable:

- A factory that names ops or tensors answers ``MUST_*`` for them (you asked explicitly, so a
  compiler should not override it) and ``PREFER_RECOMPUTE`` for every other op (plain
  checkpointing, where a compiler may still choose to save). ``recompute_ops`` is the mirror
  image: ``MUST_RECOMPUTE`` for the named ops, ``MUST_SAVE`` for the rest.
- ``either(*policies)`` keeps what any of them keeps and ``both(*policies)`` only what all of
  them keep, comparing answers in the *keep order*::

      PREFER_RECOMPUTE < MUST_RECOMPUTE < PREFER_CPU_OFFLOAD < MUST_CPU_OFFLOAD
                       < PREFER_SAVE < MUST_SAVE

  (kept on the device beats kept on the host beats not kept; at one level, MUST beats PREFER;
  a ``Compress`` answer sits just below the exact keep of its place: ``compress_ops``).
  They are the maximum and the minimum of a chain, hence the lattice laws: each is
  commutative, associative and idempotent; ``either(p, both(p, q)) == p`` and
  ``both(p, either(p, q)) == p`` (absorption); ``save_nothing()`` is the unit of ``either`` and
  ``save_everything()`` the unit of ``both``. ``tests/test_policies.py`` checks them all.
- Collectives stay kept unless the answer is ``MUST_RECOMPUTE`` (NOTE [Collectives under
  selective checkpointing]): ``both(save_matmuls(), recompute_ops(c))`` keeps ``c``.

Example:
    >>> import torch, checkpointing
    >>> from checkpointing.policies import as_context_fn, both, recompute_ops, save_matmuls
    >>> policy = both(save_matmuls(), recompute_ops(torch.ops.aten.bmm.default))
    >>> policy
    both(save_matmuls(), recompute_ops(aten.bmm.default))
    >>> x = torch.randn(2, 4, 4, requires_grad=True)
    >>> y = checkpointing.checkpoint(lambda t: torch.bmm(t, t).relu() @ t[0], x,
    ...                              use_reentrant=False, context_fn=as_context_fn(policy))
    >>> y.sum().backward()
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Final, cast

import torch

from ._compat import OpOverload, OpOverloadPacket, TorchDispatchMode
from ._compression import exact_value_ops
from ._presets import MAXTEXT_PRESETS, maxtext_placements
from ._selective import (
    Asked,
    CheckpointPolicy,
    OffloadStats,
    Op,
    Policy,
    create_selective_checkpoint_contexts,
    is_composite,
    policy_factory,
    policy_from,
    tag,
    uncalled_factory,
)
from ._selective.alternating import TorchtitanOp
from ._selective.compressing import compress_ops, compress_these_names
from ._selective.readable import _ByName, _ByOp, _combined, _Constant
from ._selective.routing import ROUTING_OPS as _ROUTING_OPS
from ._selective.unkept import overloads_of

__all__ = [
    "ATTENTION_OPS",
    "MATMUL_OPS",
    "ROUTING_OPS",
    "Policy",
    "as_context_fn",
    "both",
    "compress_ops",
    "compress_these_names",
    "either",
    "maxtext",
    "offload_ops",
    "offload_these_names",
    "recompute_ops",
    "save_attention",
    "save_everything",
    "save_matmuls",
    "save_nothing",
    "save_only_these_names",
    "save_ops",
    "save_routing",
    "tag",
]

# ``torch.nn.functional.scaled_dot_product_attention`` is a composite op: it never reaches a
# dispatch mode, which sees the kernel it picks instead, one per device kind (every release
# 2.11-2.15 has all of these). The math fallback (``_scaled_dot_product_attention_math``; on CPU
# it runs whenever ``dropout_p`` is not 0) is composite too: its ``bmm``s and softmax are what a
# mode sees, so no attention op stands for it.
_ATTENTION_KERNELS: Final = (
    "_scaled_dot_product_flash_attention",  # CUDA: FlashAttention
    "_scaled_dot_product_efficient_attention",  # CUDA: memory-efficient attention
    "_scaled_dot_product_cudnn_attention",  # CUDA: cuDNN
    "_scaled_dot_product_flash_attention_for_cpu",  # CPU
    "_scaled_dot_product_fused_attention_overrideable",  # XPU, HPU and out-of-tree backends
    "_scaled_dot_product_attention_math_for_mps",  # MPS
)


def _dispatched_overloads(names: Iterable[str]) -> frozenset[OpOverload]:
    """Every overload of the aten ops ``names`` that this torch build has and that reaches a
    dispatch mode (not a composite one, which decomposes before)."""
    return frozenset(op for op in exact_value_ops(names) if not is_composite(op))


# The ops ``save_routing`` keeps (NOTE [Routing ops], Rule 1).
ROUTING_OPS: Final[frozenset[OpOverload]] = _ROUTING_OPS
# The ops ``save_attention`` keeps: the fused scaled-dot-product attention kernels.
ATTENTION_OPS: Final[frozenset[OpOverload]] = _dispatched_overloads(_ATTENTION_KERNELS)
# The ops ``save_matmuls`` keeps: matrix products and fused scaled-dot-product attention.
MATMUL_OPS: Final[frozenset[OpOverload]] = (
    frozenset(getattr(torch.ops.aten, name).default for name in ("mm", "addmm", "bmm", "baddbmm"))
    | ATTENTION_OPS
)


# --- Factories ---------------------------------------------------------------------------------


@policy_factory
def save_nothing() -> Policy:
    """Recompute every op: plain checkpointing, expressed as a policy.

    Default: PREFER_RECOMPUTE, because that is what plain checkpointing means; a compiler may
    still keep a cheap value. The unit of ``either``.

    Example:
        >>> import torch
        >>> from checkpointing.policies import save_nothing
        >>> save_nothing()(None, torch.ops.aten.mm.default)
        <CheckpointPolicy.PREFER_RECOMPUTE: 3>
    """
    return _Constant(CheckpointPolicy.PREFER_RECOMPUTE, "save_nothing")


@policy_factory
def save_everything() -> Policy:
    """Keep every op's output: no recompute at all (for debugging, or as a unit).

    Default: MUST_SAVE, because "everything" should not be second-guessed. Note that this keeps
    *more* than running without checkpointing (every output, not only what backward needs).
    The unit of ``both``.

    Example:
        >>> import torch
        >>> from checkpointing.policies import save_everything
        >>> save_everything()(None, torch.ops.aten.relu.default)
        <CheckpointPolicy.MUST_SAVE: 0>
    """
    return _Constant(CheckpointPolicy.MUST_SAVE, "save_everything")


@policy_factory
def save_ops(*ops: Op | OpOverloadPacket) -> Policy:
    """Keep the outputs of these ops, recompute every other op.

    Each op is an ``OpOverload`` (``torch.ops.aten.mm.default``), a ``HigherOrderOperator``, or
    an ``OpOverloadPacket`` (``torch.ops.aten.mm``), which stands for all of its overloads.
    Default: MUST_SAVE for them (you named them) and PREFER_RECOMPUTE for the rest, exactly
    like torch's list form of ``create_selective_checkpoint_contexts``.

    Example:
        >>> import torch
        >>> from checkpointing.policies import save_ops
        >>> policy = save_ops(torch.ops.aten.mm.default)
        >>> policy(None, torch.ops.aten.mm.default), policy(None, torch.ops.aten.relu.default)
        (<CheckpointPolicy.MUST_SAVE: 0>, <CheckpointPolicy.PREFER_RECOMPUTE: 3>)
    """
    found = overloads_of("save_ops", ops, ATTENTION_OPS)
    return _ByOp(
        found,
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.PREFER_RECOMPUTE,
        f"save_ops({_describe(ops)})",
        Asked(found, frozenset()),
    )


@policy_factory
def save_matmuls() -> Policy:
    """Keep matrix products and fused attention (``MATMUL_OPS``), recompute the rest.

    Default: MUST_SAVE for ``mm``, ``addmm``, ``bmm``, ``baddbmm`` and the
    ``_scaled_dot_product_*_attention`` kernels of this torch build, because they dominate the
    cost of recompute while elementwise ops are cheap to redo; PREFER_RECOMPUTE for the rest.

    Example:
        >>> import torch
        >>> from checkpointing.policies import save_matmuls
        >>> save_matmuls()(None, torch.ops.aten.addmm.default)
        <CheckpointPolicy.MUST_SAVE: 0>
    """
    return _ByOp(
        MATMUL_OPS,
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.PREFER_RECOMPUTE,
        "save_matmuls()",
    )


@policy_factory
def save_attention() -> Policy:
    """Keep the outputs of fused attention (``ATTENTION_OPS``), recompute every other op.

    The common recipe "save attention, recompute the rest": attention costs the most to
    recompute per byte it keeps (its output is as small as a linear layer's). Default:
    MUST_SAVE for the kernels that ``torch.nn.functional.scaled_dot_product_attention`` runs
    on any device (flash, memory-efficient and cuDNN on CUDA, the CPU kernel, MPS and the
    overrideable one of other backends; the composite op itself never reaches a policy),
    PREFER_RECOMPUTE for the rest. Attention with dropout is recomputed all the same, since a
    random op is never kept: a fused kernel that drew says so in a warning; on CPU, dropout
    makes torch run attention as plain matrix products and a softmax, which this policy does
    not see (keep such a call with ``checkpointing.keep``, or use ``save_matmuls()``).

    Example:
        >>> import torch, checkpointing
        >>> import torch.nn.functional as F
        >>> from checkpointing.policies import as_context_fn, save_attention
        >>> q = torch.randn(1, 2, 8, 4, requires_grad=True)
        >>> y = checkpointing.checkpoint(lambda t: F.scaled_dot_product_attention(t, t, t).sin(),
        ...                              q, use_reentrant=False,
        ...                              context_fn=as_context_fn(save_attention()))
        >>> y.sum().backward()
    """
    return _ByOp(
        ATTENTION_OPS,
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.PREFER_RECOMPUTE,
        "save_attention()",
        Asked(ATTENTION_OPS, frozenset()),
    )


@policy_factory
def save_routing() -> Policy:
    """Keep the routing of mixture-of-experts layers, so that recompute cannot route differently.

    Keeps the outputs of ``ROUTING_OPS`` (the ops that pick experts and count or find their
    tokens: ``topk``, ``sort``, ``argmax``, ``histc``, ``nonzero``, ...) as copies, and the
    scores the ranking ones ranked: a recompute that computes other scores is served the
    forward's routing, and gradients equal the run without checkpointing (NOTE [Routing ops]).
    Default: MUST_SAVE for them (small: tokens x experts), PREFER_RECOMPUTE for the rest.

    Example:
        >>> import torch, checkpointing
        >>> from checkpointing.policies import as_context_fn, either, save_matmuls, save_routing
        >>> def moe(x, router, experts):
        ...     weight, expert = (x @ router).softmax(-1).topk(1)
        ...     return sum((weight * (x @ w))[expert[:, 0] == e].sum() for e, w in experts)
        >>> x, router = torch.randn(6, 4), torch.randn(4, 2, requires_grad=True)
        >>> experts = [(e, torch.randn(4, 4, requires_grad=True)) for e in range(2)]
        >>> ctx = as_context_fn(either(save_matmuls(), save_routing()))
        >>> checkpointing.checkpoint(moe, x, router, experts, use_reentrant=False,
        ...                          context_fn=ctx).backward()
    """
    return _ByOp(
        ROUTING_OPS,
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.PREFER_RECOMPUTE,
        "save_routing()",
        routing=True,
    )


@policy_factory
def recompute_ops(*ops: Op | OpOverloadPacket) -> Policy:
    """Recompute these ops, keep every other op's output.

    Default: MUST_RECOMPUTE for them and MUST_SAVE for the rest, so that
    ``both(policy, recompute_ops(...))`` is ``policy`` except on these ops (``save_everything()``
    is the unit of ``both``).

    Example:
        >>> import torch
        >>> from checkpointing.policies import both, recompute_ops, save_matmuls
        >>> policy = both(save_matmuls(), recompute_ops(torch.ops.aten.bmm))
        >>> policy(None, torch.ops.aten.bmm.default), policy(None, torch.ops.aten.mm.default)
        (<CheckpointPolicy.MUST_RECOMPUTE: 2>, <CheckpointPolicy.MUST_SAVE: 0>)
    """
    found = overloads_of("recompute_ops", ops, ATTENTION_OPS)
    return _ByOp(
        found,
        CheckpointPolicy.MUST_RECOMPUTE,
        CheckpointPolicy.MUST_SAVE,
        f"recompute_ops({_describe(ops)})",
    )


@policy_factory
def offload_ops(*ops: Op | OpOverloadPacket) -> Policy:
    """Move the outputs of these ops to host memory until backward, recompute every other op.

    Default: MUST_CPU_OFFLOAD for them (device memory is freed at the price of two copies;
    a host tensor stays where it is) and PREFER_RECOMPUTE for the rest.

    Example:
        >>> import torch
        >>> from checkpointing.policies import offload_ops
        >>> offload_ops(torch.ops.aten.mm.default)(None, torch.ops.aten.mm.default)
        <CheckpointPolicy.MUST_CPU_OFFLOAD: 4>
    """
    found = overloads_of("offload_ops", ops, ATTENTION_OPS)
    return _ByOp(
        found,
        CheckpointPolicy.MUST_CPU_OFFLOAD,
        CheckpointPolicy.PREFER_RECOMPUTE,
        f"offload_ops({_describe(ops)})",
        Asked(found, frozenset()),
    )


@policy_factory
def save_only_these_names(*names: str) -> Policy:
    """Keep the tensors named with ``tag(tensor, name)`` for these names, recompute the rest.

    Default: MUST_SAVE for the named tensors and PREFER_RECOMPUTE for every other op. The op
    that produced a kept tensor is not recomputed either (see ``tag``).

    Example:
        >>> import torch, checkpointing
        >>> from checkpointing.policies import as_context_fn, save_only_these_names, tag
        >>> def block(x, w):
        ...     return tag(x @ w, "proj").relu().sum()
        >>> w = torch.randn(4, 4, requires_grad=True)
        >>> loss = checkpointing.checkpoint(block, torch.randn(4, 4), w, use_reentrant=False,
        ...     context_fn=as_context_fn(save_only_these_names("proj")))
        >>> loss.backward()
    """
    found = _names_of("save_only_these_names", names)
    return _ByName(found, CheckpointPolicy.MUST_SAVE, f"save_only_these_names({_describe(names)})")


@policy_factory
def offload_these_names(*names: str) -> Policy:
    """Move the tensors named with ``tag(tensor, name)`` for these names to host memory until
    backward, recompute the rest.

    Default: MUST_CPU_OFFLOAD for the named tensors and PREFER_RECOMPUTE for every other op.

    Example:
        >>> import torch
        >>> from checkpointing.policies import offload_these_names
        >>> tag_op = torch.ops.checkpointing.tag.default
        >>> offload_these_names("kv")(None, tag_op, torch.ones(1), "kv")
        <CheckpointPolicy.MUST_CPU_OFFLOAD: 4>
    """
    found = _names_of("offload_these_names", names)
    return _ByName(
        found, CheckpointPolicy.MUST_CPU_OFFLOAD, f"offload_these_names({_describe(names)})"
    )


@policy_factory
def maxtext(remat_policy: str, /, **custom: str) -> Policy:
    """The policy MaxText's ``remat_policy: <name>`` stands for, over MaxText's tensor names.

    MaxText (a JAX trainer) names a decoder layer's tensors with ``checkpoint_name``
    (``query_proj``, ``key_proj``, ``value_proj``, ``qkv_proj``, ``out_proj``, ``context``,
    ``mlpwi_0``, ``mlpwi_1``, ``mlpwi``, ``mlpwo``; ``decoder_layer_input``) and picks by
    ``remat_policy`` which of them are kept on the device or moved to host memory. This is the
    same choice over the tensors named with ``tag(tensor, name)``, name for name: a preset that
    saves becomes ``save_only_these_names(...)``, one that offloads
    ``offload_these_names(...)``, ``"full"`` is ``save_nothing()`` (NOTE [MaxText presets] in
    ``checkpointing/_presets.py``; docs/guide/presets.md puts each beside MaxText's definition).
    ``checkpointing.integrations.transformers.enable`` tags a transformers model's layers with
    these names; in your own model, tag the tensors yourself.

    Args:
        remat_policy: ``"minimal_with_context"``, ``"minimal"``,
            ``"save_dot_with_context_except_mlp"``, ``"save_dot_except_mlpwi"``,
            ``"save_dot_except_mlp"``, ``"save_qkv_proj"``, ``"qkv_proj_offloaded"``,
            ``"minimal_offloaded"``, ``"save_out_proj"``, ``"full"`` or ``"custom"``. Each but
            ``"custom"`` is also a policy name: ``context_fn="maxtext:minimal"``.
        **custom: only with ``"custom"``: MaxText's per-tensor options, each ``"remat"``
            (the default), ``"device"`` or ``"offload"``, e.g. ``query_proj="offload"``.
            ``decoder_layer_input`` (the layer's input, which checkpointing keeps on the device)
            may only be ``"device"``.

    Example:
        >>> import torch, checkpointing
        >>> from checkpointing.policies import as_context_fn, maxtext, tag
        >>> maxtext("save_qkv_proj")
        save_only_these_names('query_proj', 'value_proj', 'key_proj', 'qkv_proj')
        >>> maxtext("custom", query_proj="offload", out_proj="device")
        either(save_only_these_names('out_proj'), offload_these_names('query_proj'))
        >>> def attention_in(x, w):
        ...     return tag(x @ w, "query_proj").softmax(-1)
        >>> w = torch.randn(4, 4, requires_grad=True)
        >>> y = checkpointing.checkpoint(attention_in, torch.randn(2, 4), w, use_reentrant=False,
        ...                              context_fn="maxtext:save_qkv_proj")
        >>> y.sum().backward()
    """
    saved, offloaded = maxtext_placements(remat_policy, custom)
    parts = []
    if saved:
        parts.append(save_only_these_names(*saved))
    if offloaded:
        parts.append(offload_these_names(*offloaded))
    if not parts:
        return save_nothing()
    return parts[0] if len(parts) == 1 else either(*parts)


# --- Combinators -------------------------------------------------------------------------------


@policy_factory
def either(*policies: Policy) -> Policy:
    """Keep what any of ``policies`` keeps: per op, the answer highest in the keep order.

    Default (for one policy): that policy's answers, normalised (a bool becomes MUST_SAVE or
    PREFER_RECOMPUTE). Laws: see the module docstring; ``save_nothing()`` is the unit.

    Example:
        >>> import torch
        >>> from checkpointing.policies import either, offload_ops, save_matmuls
        >>> policy = either(save_matmuls(), offload_ops(torch.ops.aten.gelu.default))
        >>> policy(None, torch.ops.aten.gelu.default), policy(None, torch.ops.aten.mm.default)
        (<CheckpointPolicy.MUST_CPU_OFFLOAD: 4>, <CheckpointPolicy.MUST_SAVE: 0>)
    """
    return _combined(_policies_of("either", policies), max, "either")


@policy_factory
def both(*policies: Policy) -> Policy:
    """Keep only what all of ``policies`` keep: per op, the answer lowest in the keep order.

    Default (for one policy): that policy's answers, normalised. Laws: see the module
    docstring; ``save_everything()`` is the unit.

    Example:
        >>> import torch
        >>> from checkpointing.policies import both, save_matmuls, save_ops
        >>> policy = both(save_matmuls(), save_ops(torch.ops.aten.mm))
        >>> policy(None, torch.ops.aten.mm.default), policy(None, torch.ops.aten.bmm.default)
        (<CheckpointPolicy.MUST_SAVE: 0>, <CheckpointPolicy.PREFER_RECOMPUTE: 3>)
    """
    return _combined(_policies_of("both", policies), min, "both")


# The policies a name stands for: those that take no arguments, and others' names for policies
# (``"maxtext:<remat_policy>"``, NOTE [MaxText presets]). The one table of names, read by
# ``as_context_fn("save_matmuls")``, by every ``context_fn="save_matmuls"`` and by
# ``integrations.transformers.enable(policy="save_matmuls")``: a configuration file or a command
# line can carry a name where it cannot carry an object.
_NAMED: Final[dict[str, Callable[[], Policy]]] = {
    factory.__name__: factory
    for factory in (save_attention, save_everything, save_matmuls, save_nothing, save_routing)
}
_NAMED.update({f"maxtext:{name}": functools.partial(maxtext, name) for name in MAXTEXT_PRESETS})
# torchtitan's "op" policy: keeps the dear ops, recomputes every second matmul of each region.
_NAMED["torchtitan:op"] = TorchtitanOp


def _named(api: str, name: str, parameter: str = "policy") -> Policy:
    """The policy ``name`` stands for, or the error listing the names (``parameter``: how the
    caller's argument is spelled in the fix)."""
    factory = _NAMED.get(name)
    if factory is None:
        names = ", ".join(map(repr, sorted(_NAMED)))
        raise ValueError(
            _MSG_POLICY_NAME.format(api=api, got=name, names=names, parameter=parameter)
        )
    return factory()


def as_context_fn(
    policy: Policy | list[Op] | str,
    *,
    allow_cache_entry_mutation: bool = False,
    offload_stats: OffloadStats | None = None,
) -> Callable[[], tuple[TorchDispatchMode, TorchDispatchMode]]:
    """The ``context_fn`` that runs a checkpointed region under ``policy``.

    Shorthand for ``functools.partial(create_selective_checkpoint_contexts, policy, ...)``,
    validated now rather than at the first forward. ``policy`` may also be the name of a policy
    that takes no arguments (``"save_matmuls"``, ``"save_attention"``, ``"save_routing"``,
    ``"save_everything"``, ``"save_nothing"``, and MaxText's remat policies as
    ``"maxtext:minimal"`` and the like (``maxtext``): the names
    ``integrations.transformers.enable`` takes too); an unknown name is an error listing them.
    Default: mutation of a saved output is an error (as in torch), and offloaded bytes go to a
    fresh ``OffloadStats`` per region unless you pass one to add them up.

    Example:
        >>> import torch, checkpointing
        >>> from checkpointing.policies import as_context_fn, save_matmuls
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> y = checkpointing.checkpoint(lambda t: (t @ t).tanh(), x, use_reentrant=False,
        ...                              context_fn=as_context_fn(save_matmuls()))
        >>> y.sum().backward()
    """
    # Build one pair now, so that a bad argument fails here and not at the first forward; a
    # list becomes its policy once, so every region shares that policy's per-op plans.
    if isinstance(policy, str):
        policy = _named("checkpointing.policies.as_context_fn", policy)
    _reject_factory("as_context_fn", policy)
    create_selective_checkpoint_contexts(
        policy, allow_cache_entry_mutation, offload_stats=offload_stats
    )
    return functools.partial(
        create_selective_checkpoint_contexts,
        policy_from(policy),
        allow_cache_entry_mutation,
        offload_stats=offload_stats,
    )


# --- Argument checks ---------------------------------------------------------------------------

_MSG_NOT_A_NAME = (
    "checkpointing.policies.{api}: expected tensor names (str), got {got!r} of type {type}. "
    "Fix: pass the names given to tag(tensor, name)."
)
_MSG_NOT_A_POLICY = (
    "checkpointing.policies.{api}: expected policies (callables "
    "`policy(ctx, op, *args, **kwargs)` such as save_matmuls()), got {got}. Fix: call the "
    "factory, e.g. {call} rather than {name}."
)
_GOT_VALUE = "{value!r} of type {type}"
_GOT_FACTORY = (
    "the factory {name} itself, which makes a policy but is not one (the first forward would "
    "fail inside torch)"
)
_MSG_POLICY_NAME = (
    "{api}: unknown policy name {got!r}; expected one of {names} (the policies of "
    "checkpointing.policies that take no arguments, and MaxText's remat_policy values as "
    "'maxtext:<name>') or a policy object. Fix: pass e.g. "
    "{parameter}='save_attention', or a policy with arguments as an object, e.g. "
    "{parameter}=checkpointing.policies.save_ops(torch.ops.aten.mm)."
)
_MSG_NO_POLICY = (
    "checkpointing.policies.{api}: expected at least one policy, got none. Fix: pass the "
    "policies to combine, e.g. {api}(save_matmuls(), offload_ops(torch.ops.aten.gelu))."
)


def _names_of(api: str, names: Iterable[object]) -> frozenset[str]:
    found: set[str] = set()
    for name in names:
        if not isinstance(name, str):
            raise TypeError(_MSG_NOT_A_NAME.format(api=api, got=name, type=type(name).__name__))
        found.add(name)
    return frozenset(found)


def _policies_of(api: str, policies: tuple[object, ...]) -> tuple[Policy, ...]:
    if not policies:
        raise ValueError(_MSG_NO_POLICY.format(api=api))
    for policy in policies:
        if not callable(policy) or isinstance(policy, type):
            raise TypeError(
                _MSG_NOT_A_POLICY.format(
                    api=api,
                    got=_GOT_VALUE.format(value=policy, type=type(policy).__name__),
                    call="save_matmuls()",
                    name="save_matmuls",
                )
            )
        _reject_factory(api, policy)
    return cast(tuple[Policy, ...], policies)  # each one checked to be callable


def _reject_factory(api: str, policy: object) -> None:
    """One of our factories passed uncalled (``save_matmuls``) is callable, but no policy: it
    would fail at the first forward, inside torch (``_selective.policy_factory``)."""
    factory = uncalled_factory(policy)
    if factory is not None:
        name, call = factory
        got = _GOT_FACTORY.format(name=name)
        raise TypeError(_MSG_NOT_A_POLICY.format(api=api, got=got, call=call, name=name))


def _describe(items: Iterable[object]) -> str:
    """``aten.mm.default, 'proj'``: how a factory's arguments appear in its repr."""
    return ", ".join(repr(item) if isinstance(item, str) else str(item) for item in items)
