"""Policies that name something to keep and keep none of it say so, once (NOTE [Selective
checkpoint cache], Rule 15); policies that name nothing, or whose ask was met, stay silent.

Every warning is an error in this suite, so a test without ``pytest.warns`` also checks that
nothing was said.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from frame_support import assert_tensors_equal, leaf
from thread_support import run_threads

import checkpointing
from checkpointing._selective import unkept
from checkpointing.policies import (
    Policy,
    as_context_fn,
    either,
    offload_ops,
    recompute_ops,
    save_attention,
    save_everything,
    save_matmuls,
    save_only_these_names,
    save_ops,
    tag,
)

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _nothing_said_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no warning given in this process (they are once-only)."""
    monkeypatch.setattr(unkept, "_said", set())


def _run(fn: Callable[..., torch.Tensor], policy: Policy, *args: torch.Tensor) -> torch.Tensor:
    """Forward and backward of ``fn`` checkpointed under ``policy``: the gradients of ``args``
    (those that require grad), which must equal the plain run's."""
    out = checkpointing.checkpoint(fn, *args, use_reentrant=False, context_fn=as_context_fn(policy))
    leaves = [a for a in args if a.requires_grad]
    ours = torch.autograd.grad(out.sum(), leaves)
    plain = torch.autograd.grad(fn(*args).sum(), leaves)
    assert_tensors_equal(ours, plain)
    return out


# --- (a) composite ops, said when the factory is called -----------------------------------------


def test_save_ops_of_the_composite_attention_warns_naming_the_kernels() -> None:
    """``save_ops(aten.scaled_dot_product_attention)`` can never match: the warning says so and
    names the device kernels and ``save_attention()``; it really keeps nothing."""
    with pytest.warns(UserWarning, match="never reaches a policy") as said:
        policy = save_ops(aten.scaled_dot_product_attention)
    text = str(said[0].message)
    assert "checkpointing.policies.save_ops: aten.scaled_dot_product_attention" in text
    assert "save_attention()" in text
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in text
    assert "aten._scaled_dot_product_efficient_attention.default" in text
    q = leaf(1, 2, 8, 4, dtype=torch.float32, seed=1)
    _run(_attention, policy, q)  # the gradients: the plain run's
    with checkpointing.saved_tensors_report() as report:
        checkpointing.checkpoint(
            _attention, q, use_reentrant=False, context_fn=as_context_fn(policy)
        ).sum().backward()
    kernel = "_scaled_dot_product_flash_attention_for_cpu"
    decisions = {r.decision for r in report.records if r.op == kernel}
    assert decisions == {"recomputed"}


def _attention(q: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, q, q).sin()


@pytest.mark.parametrize(
    ("factory", "op", "does"),
    [
        (save_ops, aten.linear.default, "keeps"),
        (offload_ops, aten.layer_norm, "offloads"),
        (recompute_ops, aten.matmul, "recomputes"),
    ],
    ids=str,
)
def test_every_op_factory_warns_once_about_a_composite_op(factory: Any, op: Any, does: str) -> None:
    """Each op factory names the composite op, what it will never do and where to look; a
    second call says nothing (once per process)."""
    with pytest.warns(UserWarning, match=rf"never {does} it: it is a composite op.*report"):
        factory(op)
    factory(op)


def test_ops_that_reach_dispatch_and_torchs_list_form_say_nothing() -> None:
    """Kernels, packets with a composite overload beside real ones (``aten.sum``), our
    generic policies, and torch's own list form (parity) are silent."""
    save_ops(aten.mm, aten.sum, aten.to, aten._scaled_dot_product_flash_attention_for_cpu)
    offload_ops(aten.addmm.default)
    save_matmuls(), save_attention(), save_everything()
    checkpointing.create_selective_checkpoint_contexts([aten.scaled_dot_product_attention.default])
    torch_checkpoint.create_selective_checkpoint_contexts(
        [aten.scaled_dot_product_attention.default]
    )


# --- (c) tags whose hand-over is refused ---------------------------------------------------------


def _norm_then_project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = tag(F.layer_norm(x, (4,)), "normed")
    return (h @ w).relu()


def _max_then_project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    values = tag(x.max(dim=-1).values, "normed")
    return (values.unsqueeze(-1) * w).relu()


def _attention_then_project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    q = x.view(1, 2, 2, 4)
    h = tag(F.scaled_dot_product_attention(q, q, q), "normed")
    return (h.reshape(4, 4) @ w).relu()


@pytest.mark.parametrize(
    ("fn", "maker"),
    [
        (_norm_then_project, "aten.native_layer_norm.default"),
        (_max_then_project, "aten.max.dim"),
        (_attention_then_project, "aten._scaled_dot_product_flash_attention_for_cpu.default"),
    ],
    ids=["layer_norm", "max.dim", "attention"],
)
def test_a_tag_on_a_several_output_op_warns_once(fn: Any, maker: str) -> None:
    """``tag(layer_norm(x))`` (or ``max.dim``, attention) with ``save_only_these_names`` keeps
    nothing (the maker returns several tensors): said once, with the maker and the fixes."""
    x, w = leaf(4, 4, dtype=torch.float32, seed=1), leaf(4, 4, dtype=torch.float32, seed=2)
    with pytest.warns(UserWarning, match="kept no tensor tagged 'normed'") as said:
        _run(fn, save_only_these_names("normed"), x, w)
    text = str(said[0].message)
    assert f"{maker} returns several tensors" in text
    assert "checkpointing.keep(fn, *args)" in text
    keep_op = "save_attention()" if "attention" in maker else f"save_ops(torch.ops.{maker})"
    assert f"either(<this policy>, {keep_op})" in text
    _run(fn, save_only_these_names("normed"), x, w)  # said once


def test_the_fix_the_warning_names_keeps_it_silently() -> None:
    """Keeping the maker by op, as the warning says, keeps the tensor: no warning."""
    x, w = leaf(4, 4, dtype=torch.float32, seed=1), leaf(4, 4, dtype=torch.float32, seed=2)
    fixed = either(save_only_these_names("normed"), save_ops(aten.native_layer_norm.default))
    with checkpointing.saved_tensors_report() as report:
        _run(_norm_then_project, fixed, x, w)
    assert any(r.op == "native_layer_norm" and r.decision == "saved" for r in report.records)


def test_a_tag_on_a_tensor_written_in_place_warns() -> None:
    """A tagged tensor last written by a recomputed in-place op is recomputed: said."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = (x @ w).relu_()
        return tag(h, "h").sin()

    x, w = leaf(4, 4, seed=1), leaf(4, 4, seed=2)
    with pytest.warns(UserWarning, match="last written in place by aten.relu_.default"):
        _run(fn, save_only_these_names("h"), x, w)


def _tagged_input(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (tag(x, "normed") @ w).sin()


def _tagged_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return tag(x @ w, "normed").sin()


def _kept_once_refused_once(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _tagged_linear(x, w) + _norm_then_project(x, w)


def _untagged(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).sin()


@pytest.mark.parametrize(
    ("fn", "policy"),
    [
        (_tagged_input, save_only_these_names("normed")),  # made outside: there for backward
        (_tagged_linear, save_only_these_names("normed")),  # handed over and kept
        (_kept_once_refused_once, save_only_these_names("normed")),  # kept some of it
        (_untagged, save_only_these_names("normed")),  # nothing of the name in the region
        (_norm_then_project, save_only_these_names("other")),  # a name it does not name
        (_norm_then_project, save_everything()),  # names nothing, and keeps the maker anyway
        (_norm_then_project, save_matmuls()),  # names nothing
    ],
    ids=["input", "linear", "kept-once", "untagged", "other-name", "everything", "matmuls"],
)
def test_no_false_alarm(fn: Any, policy: Policy) -> None:
    """A policy whose named ask was met, or that named nothing here, says nothing."""
    x, w = leaf(4, 4, dtype=torch.float32, seed=1), leaf(4, 4, dtype=torch.float32, seed=2)
    _run(fn, policy, x, w)


# --- (b) named random ops -----------------------------------------------------------------------


def _dropout(x: torch.Tensor) -> torch.Tensor:
    return torch.native_dropout(x.sin(), 0.5, True)[0].cos()  # CPU's F.dropout runs bernoulli_


@pytest.mark.parametrize(
    "policy",
    [
        save_ops(aten.native_dropout.default),
        either(save_ops(aten.native_dropout), save_only_these_names("z")),
    ],
    ids=["asked-per-op", "asked-per-call"],
)
def test_a_named_random_op_is_recomputed_and_says_so(policy: Policy) -> None:
    """``save_ops(aten.native_dropout)`` can keep nothing (a random op is always
    recomputed): said once, with the fixes, whether the policy is asked per op or per call."""
    x = leaf(8, seed=1)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"names aten.native_dropout.default to keep.*dropout_p=0"):
        out = checkpointing.checkpoint(
            _dropout, x, use_reentrant=False, context_fn=as_context_fn(policy)
        )
    out.sum().backward()


@torch.library.custom_op(
    "checkpointing_tests::scaled_noise",
    mutates_args=(),
    tags=(torch.Tag.nondeterministic_seeded,),
)
def _scaled_noise(x: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """A kernel that draws only when ``dropout_p`` is not 0, like the fused attention ones."""
    if dropout_p == 0:
        return x * 2
    return x * 2 + dropout_p * torch.rand_like(x)


_NOISE = torch.ops.checkpointing_tests.scaled_noise.default


@pytest.mark.parametrize("kept_too", [False, True], ids=["all-random", "one-kept"])
def test_a_named_op_that_draws_only_with_dropout_says_so_when_none_was_kept(
    kept_too: bool,
) -> None:
    """An op with ``dropout_p`` (as attention kernels have) is kept when it is 0 and
    recomputed when not; the region says so only if no call of it was kept."""
    x = torch.randn(4)

    def fn(t: torch.Tensor) -> torch.Tensor:
        out = _NOISE(t, 0.5)
        return out + _NOISE(t, 0.0) if kept_too else out

    context_fn = as_context_fn(save_ops(_NOISE))
    if kept_too:
        checkpointing.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
        return
    with pytest.warns(UserWarning, match="names checkpointing_tests.scaled_noise.default"):
        checkpointing.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)


# --- Attacks: threads, a forward that fails ----------------------------------------------------


def test_once_means_once_across_threads() -> None:
    """Eight threads giving the same warning at once: it is given once."""
    with pytest.warns(UserWarning, match="said once") as said:
        run_threads(lambda _: unkept.say_once(("test",), "said once"), 8)
    assert len(said) == 1


def test_a_forward_that_fails_gives_its_error_and_no_verdict() -> None:
    """A region whose forward raises after a refused tag raises that error and says nothing
    of what it kept (it kept nothing at all)."""

    def failing(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        _norm_then_project(x, w)
        raise ValueError("the user's bug")

    x, w = leaf(4, 4, dtype=torch.float32, seed=1), leaf(4, 4, dtype=torch.float32, seed=2)
    context_fn = as_context_fn(save_only_these_names("normed"))
    with pytest.raises(ValueError, match="the user's bug"):
        checkpointing.checkpoint(failing, x, w, use_reentrant=False, context_fn=context_fn)
