"""``checkpointing.policies``: what each factory answers, the combinator laws, and the policies
at work in a checkpointed region (compared with the run without checkpointing, and with torch's
selective checkpointing where the policy means the same thing there)."""

from __future__ import annotations

import doctest
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from frame_support import assert_tensors_equal, counting_ops, leaf, raised
from hypothesis import given
from hypothesis import strategies as st
from strategies import SAC_CHAIN_OPS, op_only_policies

import checkpointing
from checkpointing import policies
from checkpointing._compat import TorchDispatchMode
from checkpointing._selective import (
    TAG_OP,
    CheckpointPolicy,
    OffloadStats,
    SelectiveCheckpointContext,
    answers_by_op,
)
from checkpointing.policies import (
    MATMUL_OPS,
    as_context_fn,
    both,
    either,
    offload_ops,
    offload_these_names,
    recompute_ops,
    save_everything,
    save_matmuls,
    save_nothing,
    save_only_these_names,
    save_ops,
    tag,
)

aten = torch.ops.aten
P = CheckpointPolicy
KEEP_ORDER = [
    P.PREFER_RECOMPUTE,
    P.MUST_RECOMPUTE,
    P.PREFER_CPU_OFFLOAD,
    P.MUST_CPU_OFFLOAD,
    P.PREFER_SAVE,
    P.MUST_SAVE,
]
# The ops the laws are checked on (plus the tag op, with a name).
UNIVERSE = [aten.mm.default, aten.bmm.default, aten.relu.default, aten.sin.default]


def _ask(policy: Any, op: Any, *args: Any) -> Any:
    return policy(None, op, *args)


class Table:
    """A policy given by a table of answers per op (a default for the rest)."""

    def __init__(self, answers: dict[Any, CheckpointPolicy], default: CheckpointPolicy) -> None:
        self.answers = answers
        self.default = default

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return self.answers.get(op, self.default)

    def __repr__(self) -> str:
        return f"Table({self.answers}, {self.default})"


tables = st.builds(
    Table,
    st.dictionaries(st.sampled_from(UNIVERSE), st.sampled_from(KEEP_ORDER)),
    st.sampled_from(KEEP_ORDER),
)


def _same(p: Any, q: Any) -> bool:
    """Two policies give the same answer on every op of ``UNIVERSE``."""
    return all(_ask(p, op) == _ask(q, op) for op in UNIVERSE)


# --- What the factories answer ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "call", "expected"),
    [
        (save_nothing(), (aten.mm.default,), P.PREFER_RECOMPUTE),
        (save_everything(), (aten.relu.default,), P.MUST_SAVE),
        (save_matmuls(), (aten.addmm.default,), P.MUST_SAVE),
        (save_matmuls(), (aten.relu.default,), P.PREFER_RECOMPUTE),
        (save_ops(aten.relu.default), (aten.relu.default,), P.MUST_SAVE),
        (save_ops(aten.relu.default), (aten.mm.default,), P.PREFER_RECOMPUTE),
        (recompute_ops(aten.bmm.default), (aten.bmm.default,), P.MUST_RECOMPUTE),
        (recompute_ops(aten.bmm.default), (aten.mm.default,), P.MUST_SAVE),
        (offload_ops(aten.mm.default), (aten.mm.default,), P.MUST_CPU_OFFLOAD),
        (offload_ops(aten.mm.default), (aten.sin.default,), P.PREFER_RECOMPUTE),
        (save_only_these_names("a"), (TAG_OP, torch.ones(1), "a"), P.MUST_SAVE),
        (save_only_these_names("a"), (TAG_OP, torch.ones(1), "b"), P.PREFER_RECOMPUTE),
        (save_only_these_names("a"), (aten.mm.default,), P.PREFER_RECOMPUTE),
        (offload_these_names("a", "b"), (TAG_OP, torch.ones(1), "b"), P.MUST_CPU_OFFLOAD),
        (offload_these_names("a"), (aten.sin.default, torch.ones(1)), P.PREFER_RECOMPUTE),
    ],
    ids=repr,
)
def test_factory_answers(policy: Any, call: tuple[Any, ...], expected: CheckpointPolicy) -> None:
    """Each factory answers MUST_* for what it names and its stated default for the rest."""
    assert _ask(policy, *call) is expected


@given(policy=op_only_policies(), op=st.sampled_from(SAC_CHAIN_OPS))
def test_op_only_policies_answer_by_op_as_when_called(policy: Any, op: Any) -> None:
    """Every op-only factory, and ``either``/``both`` of them, say so, and ``answer_for_op``
    gives what calling the policy gives, with any context and arguments (the fast path of
    selective checkpointing relies on it)."""
    assert answers_by_op(policy)
    expected = policy.answer_for_op(op)
    assert _ask(policy, op) is expected
    ctx = SelectiveCheckpointContext(is_recompute=False)
    assert policy(ctx, op, torch.ones(1), "a") is expected


def test_name_based_policies_and_their_combinations_are_asked_per_call() -> None:
    """A name-based policy reads the tag's name, so it and any combination with it (or with a
    plain function) has no ``answer_for_op``; combinations of op-only policies have one."""
    names = save_only_these_names("a")
    assert not answers_by_op(names)
    assert not answers_by_op(offload_these_names("a"))
    assert not answers_by_op(either(save_matmuls(), names))
    assert not answers_by_op(both(save_everything(), lambda ctx, op, *a, **k: True))
    assert answers_by_op(both(save_matmuls(), either(save_nothing(), offload_ops(aten.mm))))
    assert _ask(either(save_matmuls(), names), TAG_OP, torch.ones(1), "a") is P.MUST_SAVE


def test_matmul_ops_are_the_matrix_products_and_fused_attention() -> None:
    """``MATMUL_OPS`` holds mm, addmm, bmm, baddbmm and every SDPA kernel (``ATTENTION_OPS``,
    checked against this release in ``tests/test_save_attention.py``)."""
    expected = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
    assert expected | policies.ATTENTION_OPS == MATMUL_OPS
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in MATMUL_OPS
    assert aten._scaled_dot_product_cudnn_attention.default in MATMUL_OPS


def test_op_packet_stands_for_all_its_overloads() -> None:
    """``save_ops(torch.ops.aten.add)`` saves ``add.Tensor`` and ``add.Scalar`` alike."""
    policy = save_ops(aten.add)
    assert _ask(policy, aten.add.Tensor) is P.MUST_SAVE
    assert _ask(policy, aten.add.Scalar) is P.MUST_SAVE
    assert _ask(policy, aten.sub.Tensor) is P.PREFER_RECOMPUTE


def test_importing_policies_leaves_torch_op_packets_alone() -> None:
    """Building ``MATMUL_OPS`` must not replace ``torch.ops.aten.mm`` and friends with new
    packets (``flop_counter`` and others key tables by the packet objects)."""
    from torch.utils.flop_counter import flop_registry

    for packet in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm):
        assert packet in flop_registry


def test_reprs_read_like_the_code() -> None:
    """A combined policy prints as the expression that built it (used in error messages)."""
    policy = either(save_matmuls(), offload_these_names("kv"), recompute_ops(aten.sin))
    assert repr(policy) == (
        "either(save_matmuls(), offload_these_names('kv'), recompute_ops(aten.sin))"
    )


def test_policies_module_examples_run() -> None:
    """Every docstring example of ``checkpointing.policies`` runs and prints what it shows."""
    result = doctest.testmod(policies, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 10
    assert result.failed == 0


# --- Bad arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize("factory", [save_ops, recompute_ops, offload_ops])
@pytest.mark.parametrize("bad", [torch.mm, "aten.mm.default", 3])
def test_op_factories_reject_non_ops(factory: Any, bad: object) -> None:
    """A Python function, a string or a number is a ``TypeError`` naming the factory."""
    exc = raised(lambda: factory(bad))
    assert isinstance(exc, TypeError)
    assert f"checkpointing.policies.{factory.__name__}" in str(exc)
    assert "torch.ops" in str(exc)


@pytest.mark.parametrize("factory", [save_only_these_names, offload_these_names])
def test_name_factories_reject_non_strings(factory: Any) -> None:
    """Names are strings: anything else is a ``TypeError`` naming the factory."""
    exc = raised(lambda: factory("ok", 3))
    assert isinstance(exc, TypeError)
    assert factory.__name__ in str(exc)


@pytest.mark.parametrize("combinator", [either, both])
def test_combinators_reject_nothing_and_non_policies(combinator: Any) -> None:
    """No policy is a ``ValueError``; a non-callable or an uncalled factory class a TypeError."""
    assert isinstance(raised(lambda: combinator()), ValueError)
    assert isinstance(raised(lambda: combinator(save_matmuls(), 3)), TypeError)
    assert isinstance(raised(lambda: combinator(CheckpointPolicy)), TypeError)


def test_combinators_normalise_bools_and_torch_members() -> None:
    """Inside a combinator, True is MUST_SAVE, False PREFER_RECOMPUTE, torch's members ours."""

    def saves_relu(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        return op is aten.relu.default

    def torch_offloads_sin(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op is aten.sin.default:
            return torch_checkpoint.CheckpointPolicy.MUST_CPU_OFFLOAD
        return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    policy = either(saves_relu, torch_offloads_sin)
    assert _ask(policy, aten.relu.default) is P.MUST_SAVE
    assert _ask(policy, aten.sin.default) is P.MUST_CPU_OFFLOAD
    assert _ask(policy, aten.mm.default) is P.PREFER_RECOMPUTE


def test_combinator_reports_the_inner_policy_that_answered_badly() -> None:
    """A bad answer inside a combination names the inner policy, not only the combination."""

    def broken(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return "save"

    exc = raised(lambda: _ask(both(save_matmuls(), broken), aten.mm.default))
    assert type(exc) is checkpointing.CheckpointError
    assert "broken" in str(exc)
    assert "'save'" in str(exc)


def test_as_context_fn_checks_its_arguments_now() -> None:
    """``as_context_fn`` fails at once on a bad policy or stats, not at the first forward."""
    assert isinstance(raised(lambda: as_context_fn(3)), TypeError)  # type: ignore[arg-type]
    stats_error = raised(lambda: as_context_fn(save_nothing(), offload_stats=1))  # type: ignore[arg-type]
    assert isinstance(stats_error, TypeError)
    stats = OffloadStats()
    forward, recompute = as_context_fn(save_nothing(), offload_stats=stats)()
    assert isinstance(forward, TorchDispatchMode)
    assert isinstance(recompute, TorchDispatchMode)
    assert forward.offload_stats is stats  # type: ignore[attr-defined]


# --- Combinator laws ------------------------------------------------------------------------------


@given(p=tables, q=tables)
def test_either_and_both_are_commutative(p: Table, q: Table) -> None:
    """``either(p, q) == either(q, p)`` and ``both(p, q) == both(q, p)``."""
    assert _same(either(p, q), either(q, p))
    assert _same(both(p, q), both(q, p))


@given(p=tables, q=tables, r=tables)
def test_either_and_both_are_associative_and_nary(p: Table, q: Table, r: Table) -> None:
    """Grouping does not matter, and the n-ary form equals the nested binary one."""
    assert _same(either(either(p, q), r), either(p, either(q, r)))
    assert _same(either(p, q, r), either(either(p, q), r))
    assert _same(both(both(p, q), r), both(p, both(q, r)))
    assert _same(both(p, q, r), both(both(p, q), r))


@given(p=tables)
def test_either_and_both_are_idempotent_with_units_and_zeros(p: Table) -> None:
    """``either(p, p) == p``; units ``save_nothing``/``save_everything``; and the zeros."""
    assert _same(either(p, p), p)
    assert _same(both(p, p), p)
    assert _same(either(p, save_nothing()), p)
    assert _same(both(p, save_everything()), p)
    assert _same(either(p, save_everything()), save_everything())
    assert _same(both(p, save_nothing()), save_nothing())


@given(p=tables, q=tables)
def test_absorption(p: Table, q: Table) -> None:
    """``either(p, both(p, q)) == p`` and ``both(p, either(p, q)) == p``."""
    assert _same(either(p, both(p, q)), p)
    assert _same(both(p, either(p, q)), p)


@given(p=tables, q=tables)
def test_either_keeps_at_least_and_both_at_most_what_each_keeps(p: Table, q: Table) -> None:
    """In the keep order, ``either`` is an upper bound of its policies and ``both`` a lower."""
    rank = KEEP_ORDER.index
    for op in UNIVERSE:
        hi, lo = _ask(either(p, q), op), _ask(both(p, q), op)
        assert rank(hi) == max(rank(_ask(p, op)), rank(_ask(q, op)))
        assert rank(lo) == min(rank(_ask(p, op)), rank(_ask(q, op)))


def test_both_with_recompute_ops_removes_only_those_ops() -> None:
    """``both(p, recompute_ops(op))`` is ``p`` on every other op (MUST_SAVE is the unit)."""
    policy = both(save_matmuls(), recompute_ops(aten.bmm.default))
    assert _ask(policy, aten.bmm.default) is P.MUST_RECOMPUTE
    for op in UNIVERSE:
        if op is not aten.bmm.default:
            assert _ask(policy, op) is _ask(save_matmuls(), op)


# --- Policies at work ---------------------------------------------------------------------


def _region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.bmm(x.unsqueeze(0), w.unsqueeze(0)).squeeze(0).relu()
    return (torch.addmm(x, h, w).sin() @ w).tanh()


def _run(context_fn: Any, checkpoint: Any = checkpointing.checkpoint) -> tuple[Any, Any]:
    x, w = leaf(4, 4, seed=1), leaf(4, 4, seed=2)
    kwargs = {} if context_fn is None else {"context_fn": context_fn}
    out = checkpoint(_region, x, w, use_reentrant=False, **kwargs)
    with counting_ops() as counts:
        out.sum().backward()
    return (x.grad, w.grad), counts


def _plain() -> tuple[Any, ...]:
    x, w = leaf(4, 4, seed=1), leaf(4, 4, seed=2)
    _region(x, w).sum().backward()
    return x.grad, w.grad


@pytest.mark.parametrize(
    "policy",
    [
        save_nothing(),
        save_everything(),
        save_matmuls(),
        save_ops(aten.relu),
        recompute_ops(aten.sin.default),
        offload_ops(aten.bmm.default),
        either(save_matmuls(), offload_ops(aten.relu.default)),
        both(save_matmuls(), recompute_ops(aten.addmm.default)),
    ],
    ids=repr,
)
def test_every_policy_gives_the_plain_gradients(policy: Any) -> None:
    """Whatever a policy keeps, the gradients equal the run without checkpointing."""
    grads, _ = _run(as_context_fn(policy))
    assert_tensors_equal(grads, _plain())


def test_save_nothing_recomputes_like_plain_checkpoint() -> None:
    """``save_nothing()`` runs the same backward ops as checkpoint without ``context_fn``."""
    _, nothing = _run(as_context_fn(save_nothing()))
    _, plain_checkpoint = _run(None)
    assert nothing == plain_checkpoint


def test_save_matmuls_recomputes_no_matmul() -> None:
    """Under ``save_matmuls()`` backward runs only the gradient matmuls (2 per product)."""
    _, nothing = _run(as_context_fn(save_nothing()))
    _, matmuls = _run(as_context_fn(save_matmuls()))
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        assert nothing[str(op)] > matmuls[str(op)], op
    assert matmuls[str(aten.bmm.default)] == 2


def test_save_everything_recomputes_nothing() -> None:
    """Under ``save_everything()`` no forward op is re-run: the tanh of the output is not."""
    _, everything = _run(as_context_fn(save_everything()))
    _, nothing = _run(as_context_fn(save_nothing()))
    assert everything[str(aten.sin.default)] == 0
    assert nothing[str(aten.sin.default)] == 1


def test_save_matmuls_keeps_cpu_attention_too() -> None:
    """On CPU, SDPA runs ``_scaled_dot_product_flash_attention_for_cpu``, which is kept."""
    q = leaf(2, 2, 8, 4, dtype=torch.float32, seed=3)

    def attention(q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.sin(), q, q).cos()

    out = checkpointing.checkpoint(
        attention, q, use_reentrant=False, context_fn=as_context_fn(save_matmuls())
    )
    with counting_ops() as counts:
        out.sum().backward()
    grad, q.grad = q.grad, None
    attention(q).sum().backward()
    assert_tensors_equal((grad,), (q.grad,))
    assert counts[str(aten._scaled_dot_product_flash_attention_for_cpu.default)] == 0


@pytest.mark.parametrize(
    "policy", [save_matmuls(), save_ops(aten.relu), recompute_ops(aten.sin.default)], ids=repr
)
def test_our_policies_work_with_torch_contexts_too(policy: Any) -> None:
    """Our answers equal torch's members, so torch's SAC honours them: same ops recomputed."""
    torch_context = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, policy)
    theirs, torch_counts = _run(torch_context, torch_checkpoint.checkpoint)
    ours, our_counts = _run(as_context_fn(policy))
    assert our_counts == torch_counts
    assert_tensors_equal(ours, theirs)


# --- tag -----------------------------------------------------------------------------------


def test_tag_is_a_free_identity_outside_checkpoints() -> None:
    """``tag`` returns its argument unchanged, adds no autograd node, and gradients flow."""
    x = leaf(3, seed=4)
    h = x * 2
    assert tag(h, "h") is h
    assert h.grad_fn is not None
    assert h.grad_fn.name() == "MulBackward0"
    tag(h, "h").sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0, dtype=torch.float64))


def test_tag_checks_its_arguments() -> None:
    """A non-tensor or a non-string name is a ``TypeError`` that shows the fix."""
    assert isinstance(raised(lambda: tag([1.0], "h")), TypeError)  # type: ignore[arg-type]
    exc = raised(lambda: tag(torch.ones(1), 3))  # type: ignore[arg-type]
    assert isinstance(exc, TypeError)
    assert "tag(h, 'attn_out')" in str(exc)


def test_torchtitan_op_counts_each_region_from_zero() -> None:
    """NOTE [Per-region policies], Rule 1: under the one object the name stands for, each region
    keeps the 1st and 3rd of its three matmuls (not a count carried over from the region
    before), and the gradients are the plain run's."""
    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]

    def block(x: torch.Tensor) -> torch.Tensor:
        for w in weights:
            x = torch.tanh(x @ w)
        return x

    x = torch.randn(4, 8, requires_grad=True)
    h = x
    with checkpointing.saved_tensors_report() as report:
        for _ in range(2):
            h = checkpointing.checkpoint(block, h, use_reentrant=False, context_fn="torchtitan:op")
        h.sum().backward()
    # one label for both regions (one function): 2 + 2 matmuls kept; a count carried over would
    # keep the 1st and 3rd, then only the 5th (3 in all)
    kept = [r.kept_ops for r in report.regions().values()]
    assert kept == [{"mm": (4, 4 * 4 * 8 * 4)}], kept
    got = [w.grad.clone() for w in weights]
    for w in weights:
        w.grad = None
    block(block(x)).sum().backward()
    assert all(torch.equal(g, w.grad) for g, w in zip(got, weights, strict=True))
