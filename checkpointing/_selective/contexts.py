"""``create_selective_checkpoint_contexts``: the pair of modes a checkpoint enters.

The one place that knows both modes: it checks its arguments (the policy through
``policy.policy_from``), makes the region's ``cache._Cache`` and hands it to a ``forward`` and a
``recompute`` mode; a policy that counts within a region is copied fresh for each (NOTE
[Per-region policies]). Entering them around forward and recompute is the frame's job (``_frame``,
through ``context_fn``).
"""

from __future__ import annotations

from .._compat import TorchDispatchMode
from .._offload import OffloadStats
from .cache import _Cache
from .forward import _CachingMode
from .ops import Op
from .policy import Policy, policy_from
from .recompute import _CachedMode

_MSG_NOT_STATS = (
    "create_selective_checkpoint_contexts: offload_stats must be a checkpointing.OffloadStats or "
    "None, got {got!r} of type {type}. Fix: pass `checkpointing.OffloadStats()`."
)


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Policy | list[Op],
    allow_cache_entry_mutation: bool = False,
    *,
    offload_stats: OffloadStats | None = None,
) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The two contexts of selective checkpointing, for ``checkpoint(..., context_fn=...)``.

    Same behaviour as ``torch.utils.checkpoint.create_selective_checkpoint_contexts``, except
    that offload decisions really offload (to host memory and back), that a policy answer
    which is neither a ``CheckpointPolicy`` nor a bool is a ``CheckpointError`` instead of a
    silent recompute, and that functional collectives (``torch.ops._c10d_functional``: what
    tensor parallelism runs) are kept unless the policy answers ``MUST_RECOMPUTE`` for them,
    the ranks of each group checking once that they agree (NOTE [Collectives under selective
    checkpointing]; torch recomputes a collective its policy does not keep).

    Args:
        policy_fn_or_list: a policy ``policy(ctx, op, *args, **kwargs)`` returning a
            ``CheckpointPolicy`` (or a bool: True saves, False recomputes), called once per op
            of the forward with ``ctx.op_output`` set; or a list of ``OpOverload``s, meaning
            MUST_SAVE for those ops and PREFER_RECOMPUTE for the rest.
        allow_cache_entry_mutation: do not raise when a saved output was changed in place
            after it was cached.
        offload_stats: where to add the bytes offloaded and restored (ours; a fresh
            ``OffloadStats`` per pair by default, reachable as ``.offload_stats`` on each mode).

    Returns:
        ``(forward_context, recompute_context)``: two ``TorchDispatchMode``s.

    Example:
        >>> import functools, torch, checkpointing
        >>> ops = [torch.ops.aten.mm.default]
        >>> ctx = functools.partial(checkpointing.create_selective_checkpoint_contexts, ops)
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> y = checkpointing.checkpoint(lambda t: (t @ t).sin(), x, use_reentrant=False,
        ...                              context_fn=ctx)
        >>> y.sum().backward()
    """
    policy = policy_from(policy_fn_or_list)
    fresh = getattr(policy, "for_region", None)
    if callable(fresh):  # NOTE [Per-region policies], Rule 1 (in ``alternating``)
        policy = fresh()
    if offload_stats is not None and not isinstance(offload_stats, OffloadStats):
        raise TypeError(_MSG_NOT_STATS.format(got=offload_stats, type=type(offload_stats).__name__))
    cache = _Cache(offload_stats)
    return _CachingMode(policy, cache), _CachedMode(cache, bool(allow_cache_entry_mutation))
