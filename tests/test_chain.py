"""``checkpoint_chain``: one checkpoint frame across consecutive module calls (NOTE [Checkpoint
chains]), against the run without checkpointing and ``torch.utils.checkpoint``'s
``checkpoint_sequential`` on the same blocks and segments."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hf_support import BATCH, SEQ, VOCAB, tiny_llama
from planner_support import encoder, encoder_inputs, forced_plan, grads_of
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import checkpointing
from checkpointing import _compat
from checkpointing._chain import checkpoint_chain, is_module_chained, unchain_found
from checkpointing._planning.solve.problem import Choice

WIDTH = 8


class Block(nn.Module):
    """A residual block with dropout: a chain replaying it must draw as the forward drew."""

    def __init__(self, p: float = 0.25, fail: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(p)
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("block failed on purpose")
        return x + self.drop(torch.tanh(self.lin(x)))


Gap = Callable[[torch.Tensor], torch.Tensor]


class Net(nn.Module):
    """A stem, then blocks in a loop (``gap`` runs between two blocks), so a chain's input is an
    activation; ``calls`` blocks are called (an early exit where fewer than all)."""

    def __init__(self, blocks: int = 4, p: float = 0.25, gap: Gap | None = None) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(Block(p) for _ in range(blocks))
        self.gap = gap
        self.calls = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        for block in self.layers[: self.calls]:
            h = block(h)
            if self.gap is not None:
                h = self.gap(h)
        return h


def _net(**kwargs: Any) -> Net:
    torch.manual_seed(0)
    return Net(**kwargs)


def _x() -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _grads(model: nn.Module, run: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Input and parameter gradients of one step, the RNG seeded the same for every run."""
    x = _x()
    torch.manual_seed(7)
    loss = run(x).square().sum()
    grads = torch.autograd.grad(loss, [x, *model.parameters()], materialize_grads=True)
    return list(grads)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


@contextmanager
def _saved_bytes() -> Iterator[list[int]]:
    """The bytes of the distinct storages saved for backward through the saved-tensors hooks
    (what a checkpoint keeps: its inputs; what runs plainly: every save)."""
    seen: dict[int, int] = {}
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        total[0] = sum(seen.values())
        return t.detach()  # the tensor itself would tie an output to its own node: a cycle

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def _kept(model: nn.Module, x: torch.Tensor) -> int:
    """The activation bytes the step keeps, from the graph (nothing recomputed)."""
    torch.manual_seed(7)
    return checkpointing.saved_tensors_report(model(x).sum(), model=model).activation_bytes


def test_gradients_bitwise_against_plain_and_checkpoint_sequential() -> None:
    """Rule 1: chains over the segments ``checkpoint_sequential`` makes (its last segment runs
    plainly) give the plain run's gradients bitwise, with dropout, and save the same bytes."""
    model = _net(blocks=6)
    plain = _grads(model, model)

    def sequential(x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(model.stem(x))
        return checkpoint_sequential(model.layers, 3, h, use_reentrant=False)  # type: ignore[no-any-return]

    torch_grads = _grads(model, sequential)
    with _saved_bytes() as torch_bytes:
        torch.manual_seed(7)
        sequential(_x())
    handles = [checkpoint_chain(model.layers[i : i + 2], model) for i in (0, 2)]
    ours = _grads(model, model)
    with _saved_bytes() as our_bytes:
        torch.manual_seed(7)
        model(_x())
    for handle in handles:
        handle.remove()
    assert _equal(ours, plain)
    assert _equal(torch_grads, plain)
    assert our_bytes[0] == torch_bytes[0] > 0


def test_one_input_kept_per_chain() -> None:
    """Rule 1: a chain of four blocks keeps one input and one RNG state, where a checkpoint per
    block keeps four of each (the report's activation bytes: three of each fewer)."""
    model = _net()
    x = _x()
    for block in model.layers:
        checkpointing.checkpoint_module(block)
    per_block = _kept(model, x)
    for block in model.layers:
        checkpointing.remove_checkpoint_module(block)
    handle = checkpoint_chain(model.layers, model)
    chained = _kept(model, x)
    handle.remove()
    boundary = x.numel() * x.element_size()
    rng_state = torch.get_rng_state().numel()
    assert per_block - chained == 3 * (boundary + rng_state)


def test_a_gap_op_breaks_the_chain() -> None:
    """Rule 3: an op between two blocks (``h = block(h) * 1.0``) breaks the chain there: each
    block is a frame of its own, gradients stay bitwise."""
    model = _net(gap=lambda h: h * 1.0)
    plain = _grads(model, model)
    for block in model.layers:
        checkpointing.checkpoint_module(block)
    per_block = _kept(model, _x())
    for block in model.layers:
        checkpointing.remove_checkpoint_module(block)
    handle = checkpoint_chain(model.layers, model)
    assert _equal(_grads(model, model), plain)
    assert _kept(model, _x()) == per_block
    handle.remove()


def test_a_gap_that_draws_stays_bitwise() -> None:
    """Rule 3: dropout between the blocks would shift the replay's random numbers in one frame;
    the chain breaks there and the gradients stay bitwise."""
    model = _net(gap=lambda h: F.dropout(h, 0.5))
    plain = _grads(model, model)
    handle = checkpoint_chain(model.layers, model)
    assert _equal(_grads(model, model), plain)
    handle.remove()


class HookedNet(Net):
    """Runs each block under saved-tensors hooks of its own (``save_on_cpu``), pushed and popped
    in the gaps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        for block in self.layers:
            with torch.autograd.graph.save_on_cpu():
                h = block(h)
        return h


def test_hooks_pushed_in_the_gaps() -> None:
    """Rules 3 and 4: a root that pushes saved-tensors hooks around each block breaks the chain
    at each (the frame's user hooks changed) and leaves the stack as found; bitwise."""
    torch.manual_seed(0)
    model = HookedNet()
    plain = _grads(model, model)
    handle = checkpoint_chain(model.layers, model)
    assert _equal(_grads(model, model), plain)
    assert _compat.top_saved_tensors_hooks() is None
    handle.remove()


class _Counting(_compat.TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
    """Counts the ops it sees, across instances."""

    seen = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        _Counting.seen += 1
        return func(*args, **(kwargs or {}))


class ModeNet(Net):
    """Runs its second block under a dispatch mode of its own, entered and left in the gaps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        for index, block in enumerate(self.layers):
            if index == 1:
                with _Counting():
                    h = block(h)
            else:
                h = block(h)
        return h


def test_a_mode_entered_in_a_gap() -> None:
    """Rule 4: a dispatch mode the root enters between two chained blocks and leaves after the
    next: the mode sees that block's ops (it runs plainly), the chain breaks at the one after;
    stacks as found, bitwise."""
    torch.manual_seed(0)
    model = ModeNet()
    plain = _grads(model, model)
    seen = _Counting.seen
    handle = checkpoint_chain(model.layers, model)
    _Counting.seen = 0
    assert _equal(_grads(model, model), plain)
    assert _Counting.seen == seen > 0
    assert _compat.dispatch_mode_depth() == 0
    assert not handle._chain.open
    handle.remove()


def test_early_exit_ends_the_frame_at_the_root() -> None:
    """Rule 4: a root that calls only the first chained block leaves no frame open (hook and
    mode stacks as found); the next full step is bitwise."""
    model = _net()
    model.calls = 1
    plain_short = _grads(model, model)
    model.calls = 4
    plain = _grads(model, model)
    handle = checkpoint_chain(model.layers[0:3], model)
    model.calls = 1
    assert _equal(_grads(model, model), plain_short)
    assert _compat.dispatch_mode_depth() == 0
    model.calls = 4
    assert _equal(_grads(model, model), plain)
    handle.remove()


def test_an_exception_in_the_second_block_then_a_normal_step() -> None:
    """Rule 4: a chained block that raises leaves the saved-tensors hook stack and the mode
    stack as found; the next step works and is bitwise."""
    model = _net()
    plain = _grads(model, model)
    handle = checkpoint_chain(model.layers, model)
    model.layers[1].fail = True
    with pytest.raises(RuntimeError, match="failed on purpose"):
        model(_x())
    assert _compat.top_saved_tensors_hooks() is None
    assert _compat.dispatch_mode_depth() == 0
    model.layers[1].fail = False
    assert _equal(_grads(model, model), plain)
    handle.remove()


def test_two_threads() -> None:
    """Rule 5: two threads run the chained model at once; each gets the plain gradients."""
    model = _net(p=0.0)
    plain = _grads(model, model)
    handle = checkpoint_chain(model.layers, model)
    results: list[bool] = []
    barrier = threading.Barrier(2)

    def step() -> None:
        barrier.wait()
        results.append(all(_equal(_grads(model, model), plain) for _ in range(3)))

    threads = [threading.Thread(target=step) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    handle.remove()
    assert results == [True, True]


class Inner(nn.Module):
    """Calls ``shared``, the next chained block, inside its own forward first."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.shared = [shared]  # not a submodule: the root owns it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared[0](torch.tanh(self.lin(x)))


class Nesting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.second = Block()
        self.first = Inner(self.second)
        self.third = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.third(self.second(self.first(x)))


def test_a_member_called_inside_another() -> None:
    """Rule 5: a chained block called inside the running one is part of that call; the chain
    goes on at its next call from the root, and ends; bitwise."""
    torch.manual_seed(0)
    model = Nesting()
    plain = _grads(model, model)
    handle = checkpoint_chain([model.first, model.second, model.third], model)
    assert _equal(_grads(model, model), plain)
    assert not handle._chain.open
    handle.remove()


class Watching(Net):
    """Notes whether the first block's output still lives when the third block starts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](torch.relu(self.stem(x)))
        first = weakref.ref(h)
        h = self.layers[1](h)
        self.first_alive = first() is not None
        return self.layers[2](h)


def test_boundaries_die_in_forward() -> None:
    """Rule 2: a boundary the root no longer holds is freed during the forward, as without
    the chain: the chain holds earlier outputs weakly."""
    model = Watching(blocks=3)
    handle = checkpoint_chain(model.layers, model)
    model(_x()).sum().backward()
    handle.remove()
    assert not model.first_alive


def test_no_grad_opens_no_frame() -> None:
    """Rule 8: under ``no_grad`` the chained model runs plainly and nothing stays open."""
    model = _net()
    handle = checkpoint_chain(model.layers, model)
    with torch.no_grad():
        model(_x())
    assert not handle._chain.open
    assert not handle._chain.depth
    handle.remove()


def test_nested_in_an_outer_checkpoint_and_around_a_checkpointed_child() -> None:
    """Rule 6: a chain inside an outer checkpoint, and a checkpointed child inside a chained
    block, both give the plain gradients bitwise."""
    model = _net()
    plain = _grads(model, model)
    handle = checkpoint_chain(model.layers, model)

    def outer(x: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint(model, x, use_reentrant=False)  # type: ignore[no-any-return]

    assert _equal(_grads(model, outer), plain)
    checkpointing.checkpoint_module(model.layers[1].lin)
    assert _equal(_grads(model, model), plain)
    checkpointing.remove_checkpoint_module(model.layers[1].lin)
    handle.remove()


def test_a_policy_and_debug_across_the_chain() -> None:
    """Rule 1: a selective policy (one ``context_fn`` for the chain) and ``debug=True`` work
    across the chained blocks."""
    model = _net()
    plain = _grads(model, model)
    handle = checkpoint_chain(model.layers, model, context_fn=checkpointing.policies.save_matmuls())
    assert _equal(_grads(model, model), plain)
    handle.remove()
    handle = checkpoint_chain(model.layers, model, debug=True)
    assert _equal(_grads(model, model), plain)
    handle.remove()


def test_remove_copy_and_pickle() -> None:
    """Rule 9: ``remove`` takes every hook off; a deep copy and a pickle of a chained model run
    bitwise, and ``unchain_found`` takes the copy's hooks off."""
    model = _net()
    plain = _grads(model, model)
    handle = checkpoint_chain(model.layers, model)
    copied = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    handle.remove()
    assert not any(is_module_chained(block) for block in model.layers)
    assert not model._forward_pre_hooks
    assert not model._forward_hooks
    assert all("forward" not in block.__dict__ for block in model.layers)
    assert _equal(_grads(model, model), plain)
    for other in (copied, loaded):
        assert all(is_module_chained(block) for block in other.layers)
        assert _equal(_grads(other, other), plain)
        unchain_found(other.layers, other)
        assert not any(is_module_chained(block) for block in other.layers)
        assert not other._forward_pre_hooks


def test_bad_chains_are_refused() -> None:
    """Bad input raises with the API, what was wrong and the fix."""
    model = _net()
    with pytest.raises(ValueError, match="at least 2 modules, got 1"):
        checkpoint_chain(model.layers[0:1], model)
    with pytest.raises(ValueError, match="listed twice"):
        checkpoint_chain([model.layers[0], model.layers[0]], model)
    checkpointing.checkpoint_module(model.layers[1])
    with pytest.raises(ValueError, match="checkpointed already"):
        checkpoint_chain(model.layers[0:2], model)
    with pytest.raises(TypeError, match=r"expected nn\.Modules"):
        checkpoint_chain([model.layers[0], 3], model)  # type: ignore[list-item]


@pytest.mark.once
def test_hugging_face_blocks_with_keyword_constants() -> None:
    """Rule 2: a tiny Llama's decoder layers take the mask and rotary embeddings by keyword:
    they are constants, the chain does not break (three boundaries and RNG states fewer than a
    checkpoint per layer) and the gradients are the plain run's, bitwise, with dropout."""
    torch.manual_seed(0)
    model = tiny_llama(4, attention_dropout=0.2)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    layers = model.model.layers

    def step() -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(7)
        loss = model(ids, labels=ids).loss
        kept = checkpointing.saved_tensors_report(loss, model=model).activation_bytes
        return list(torch.autograd.grad(loss, list(model.parameters()))), kept

    plain, _ = step()
    for layer in layers:
        checkpointing.checkpoint_module(layer)
    per_layer_grads, per_layer = step()
    for layer in layers:
        checkpointing.remove_checkpoint_module(layer)
    handle = checkpoint_chain(layers, model)
    chained_grads, chained = step()
    handle.remove()
    assert _equal(per_layer_grads, plain)
    assert _equal(chained_grads, plain)
    boundary = BATCH * SEQ * model.config.hidden_size * 4
    assert per_layer - chained == 3 * (boundary + torch.get_rng_state().numel())


def _plan(model: nn.Module, joined: tuple[int, ...], trail: str | None = None) -> Any:
    """A plan of ``model``'s blocks whose JSON is edited: every block checkpointed whole, the
    blocks at ``joined`` joined to the block before, and a trail ending ``trail``'s frame at its
    dropout (NOTE [Planner apply], Rule A4)."""
    plan = checkpointing.plan_checkpointing(model, _x(), budget=1.0, loss_fn=_loss)
    data = json.loads(plan.to_json())
    for index, region in enumerate(data["regions"]):
        region.update(checkpoint=True, save=[], offload=[], skip=[], keep_draws=False)
        region["joined"] = index in joined
    if trail is not None:
        span = {"kind": "trail", "first": trail, "last": f"{trail}.drop"}
        data["spans"].append({**span, "recompute_ms": 0.0, "recompute_flops": 0})
    return checkpointing.ActivationPlan.from_json(json.dumps(data))


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.square().sum()


def test_a_plan_edited_to_join_regions_applies_bitwise() -> None:
    """Rule A4: a plan whose JSON joins blocks 0-2 installs one chain for them: gradients
    bitwise, two boundaries and RNG states fewer kept than the same plan unjoined."""
    model = _net()
    plain = _grads(model, model)
    x = _x()
    apart = _plan(model, ())
    apart.apply(model)
    assert _equal(_grads(model, model), plain)
    kept_apart = _kept(model, x)
    apart.remove(model)
    joined = _plan(model, (1, 2))
    assert [r.joined for r in joined.regions] == [False, True, True, False]
    joined.apply(model)
    assert is_module_chained(model.layers[1])
    assert _equal(_grads(model, model), plain)
    boundary = x.numel() * x.element_size()
    assert kept_apart - _kept(model, x) == 2 * (boundary + torch.get_rng_state().numel())
    joined.remove(model)


def test_a_trail_ends_the_last_joined_region() -> None:
    """Rule A4: a trail of a run's last region ends the chain's frame at its child; bitwise."""
    model = _net()
    plain = _grads(model, model)
    plan = _plan(model, (1, 2), trail="layers.2")
    plan.apply(model)
    assert _equal(_grads(model, model), plain)
    plan.remove(model)


def test_a_joined_plan_comes_off_a_copy() -> None:
    """NOTE [Installed plan], Rule 1: a joined plan comes off a deep copy of the applied model
    and off the model itself, trail included: no hook of it is left on any module."""
    model = _net()
    plan = _plan(model, (1, 2), trail="layers.2")
    plan.apply(model)
    copied = copy.deepcopy(model)
    plan.remove(copied)
    plan.remove(model)
    for module in (*model.modules(), *copied.modules()):
        assert not module._forward_pre_hooks
        assert not module._forward_hooks
        assert "forward" not in module.__dict__


def test_apply_refuses_joins_it_cannot_install() -> None:
    """Rule A4: a first region joined, a region joined to one not checkpointed, a joined run
    with a selective region and a region joined after a trail are refused, nothing installed."""
    model = _net()
    plan = _plan(model, (2,), trail="layers.1")

    def refused(regions: list[Any], match: str) -> None:
        plan.regions = tuple(regions)
        with pytest.raises(ValueError, match=match):
            plan.apply(model)
        assert not any(m._forward_pre_hooks for m in model.modules())

    base = list(plan.regions)
    whole = [dataclasses.replace(r, joined=False) for r in base]
    refused([dataclasses.replace(base[0], joined=True), *whole[1:]], "it is the first region")
    off = dataclasses.replace(base[1], checkpoint=False)
    refused([whole[0], off, *base[2:]], r"'layers\.1', is not checkpointed")
    saving = dataclasses.replace(base[1], save=(("aten.addmm.default", 0),))
    refused([whole[0], saving, *base[2:]], "keeps, offloads or skips ops of its own")
    refused(base, r"'layers\.1' ends its frame at the start of its child 'layers\.1\.drop'")


@pytest.mark.once
def test_under_compile_each_member_is_torchs_region() -> None:
    """Rule 7: under ``torch.compile`` (aot_eager) each chained block is torch's own region:
    the gradients are the plain run's, and eager steps before and after still chain."""
    model = _net(p=0.0)
    plain = _grads(model, model)
    handle = checkpoint_chain(model.layers, model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    assert _equal(_grads(model, compiled), plain)
    assert _equal(_grads(model, model), plain)
    assert not handle._chain.open
    handle.remove()
    torch._dynamo.reset()


_W, _J, _P = Choice(True), Choice(True, joined=True), Choice(False)


def test_a_joined_plan_keeps_what_the_planner_predicts() -> None:
    """Rule A4 against the planner's count (NOTE [Planner solve], Rule S9): a plan of the
    residual blocks with dropout, joined in two pairs, keeps exactly the bytes it predicts (the
    report's activation bytes) and gives the plain run's gradients bitwise."""
    model = _net()
    x = _x()
    plain = grads_of(model, x, None)
    plan = forced_plan(model, x, lambda _, i: (_W, _J, _W, _J)[i])
    assert [r.joined for r in plan.regions] == [False, True, False, True]
    _check_prediction(plan, model, x, plain)


@pytest.mark.once
def test_a_joined_encoder_plan_keeps_what_the_planner_predicts() -> None:
    """As above on post-norm encoder blocks with dropout: the first kept, the others joined
    after a whole one."""
    model = encoder(depth=4)
    x = encoder_inputs().requires_grad_()
    plain = grads_of(model, x, None)
    pattern = (_P, _W, _J, _J)
    _check_prediction(forced_plan(model, x, lambda _, i: pattern[i]), model, x, plain)


def _check_prediction(
    plan: checkpointing.ActivationPlan, model: nn.Module, x: torch.Tensor, plain: Any
) -> None:
    plan.apply(model)
    torch.manual_seed(7)
    kept = checkpointing.saved_tensors_report(model(x).sum(), model=model).activation_bytes
    assert _equal(list(grads_of(model, x, None)), list(plain))
    plan.remove(model)
    assert kept == plan.kept_bytes
