"""torch.distributed's wrapper API under our names (issue 39, NOTE [Module wrapper] Rules 5-7 and
NOTE [Applied wrappers]).

Every spelling is built twice from one seed, once with torch.distributed's wrapper and once with
ours, and compared in the same test: module names and classes, ``state_dict`` keys, gradients
(bitwise, with dropout, and equal to the unwrapped model's) and the bytes kept for backward.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from dist_support import free_port
from offload_support import FakeBackend
from thread_support import run_threads
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrappers
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

import checkpointing
from checkpointing import _compat, _offload
from checkpointing.policies import as_context_fn, save_matmuls


class Block(nn.Module):
    """Two linears, a dropout and a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 12)
        self.drop = nn.Dropout(0.3)
        self.down = nn.Linear(12, 6)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + self.down(self.drop(torch.tanh(self.up(x)))) * scale


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), nn.ReLU(), Block(), nn.Linear(6, 2)).double()


def _is_block(module: nn.Module) -> bool:
    return isinstance(module, Block)


def _block_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or isinstance(module, Block)


X = torch.randn(5, 6, dtype=torch.float64)
Lib = types.ModuleType  # ``torch_wrappers`` or ``checkpointing``: the same names in each
Spelling = Callable[[Lib, nn.Sequential], None]


def _each_block(wrap: Callable[[Lib, nn.Module], nn.Module]) -> Spelling:
    def apply(lib: Lib, model: nn.Sequential) -> None:
        for i in (0, 2):
            model[i] = wrap(lib, model[i])

    return apply


SPELLINGS: dict[str, Spelling] = {
    "checkpoint_wrapper(m)": _each_block(lambda lib, m: lib.checkpoint_wrapper(m)),
    "checkpoint_impl=NO_REENTRANT": _each_block(
        lambda lib, m: lib.checkpoint_wrapper(m, checkpoint_impl=lib.CheckpointImpl.NO_REENTRANT)
    ),
    "checkpoint_impl=REENTRANT": _each_block(
        lambda lib, m: lib.checkpoint_wrapper(m, lib.CheckpointImpl.REENTRANT)
    ),
    "CheckpointWrapper(m)": _each_block(lambda lib, m: lib.CheckpointWrapper(m)),
    "checkpoint_fn=torch's checkpoint": _each_block(
        lambda lib, m: lib.checkpoint_wrapper(
            m, checkpoint_fn=torch_checkpoint.checkpoint, use_reentrant=False
        )
    ),
    "offload_wrapper(m)": _each_block(lambda lib, m: lib.offload_wrapper(m)),
    "OffloadWrapper(m)": _each_block(lambda lib, m: lib.OffloadWrapper(m)),
    "apply(check_fn)": lambda lib, model: lib.apply_activation_checkpointing(
        model, check_fn=_is_block
    ),
    "apply(ModuleWrapPolicy)": lambda lib, model: lib.apply_activation_checkpointing(
        model, auto_wrap_policy=ModuleWrapPolicy({Block})
    ),
    "apply(CustomPolicy)": lambda lib, model: lib.apply_activation_checkpointing(
        model, auto_wrap_policy=CustomPolicy(_is_block)
    ),
    "apply(callable policy)": lambda lib, model: lib.apply_activation_checkpointing(
        model, auto_wrap_policy=_block_policy
    ),
    "apply(offload_wrapper)": lambda lib, model: lib.apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=lib.offload_wrapper, check_fn=_is_block
    ),
}


def _grads(model: nn.Module) -> list[torch.Tensor]:
    torch.manual_seed(3)
    x = X.clone().requires_grad_()
    model(x).pow(2).sum().backward()
    assert x.grad is not None
    return [p.grad for p in model.parameters() if p.grad is not None] + [x.grad]


def _kept_bytes(model: nn.Module) -> int:
    """Bytes of distinct storages a saved-tensors hook around the step sees saved."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(X.clone().requires_grad_()).sum()
    return sum(storages.values())


def _blocks_save_contiguous_copies(model: nn.Sequential) -> nn.Sequential:
    """``model`` unwrapped, but each block's saved tensors come back as contiguous copies, as
    torch's ``offload_wrapper`` packs them (``save_on_cpu`` copies into ``torch.empty(size)``)."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.size(), dtype=t.dtype).copy_(t)

    for block in model.modules():
        if isinstance(block, Block):
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            block.register_forward_pre_hook(lambda _m, _a, h=hooks: h.__enter__())
            block.register_forward_hook(lambda _m, _a, _o, h=hooks: h.__exit__(None, None, None))
    return model


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_each_spelling_side_by_side_with_torchs_wrapper(spelling: str) -> None:
    """Same module names and classes, state_dict keys, kept bytes and gradients (bitwise, with
    dropout) as torch.distributed's wrapper; our gradients equal the unwrapped model's bitwise.

    Torch's offload wrapper brings every saved tensor back contiguous: the transposed weight
    view a linear saves returns as a plain matrix, so its backward matmul takes another BLAS
    layout, which on some CPUs (an AMD EPYC) sums in another order. Ours keeps the strides, so
    it takes the plain run's kernels and matches it bitwise; torch's is compared bitwise with
    the plain run whose blocks save contiguous copies (the same kernels), and within rounding
    with the plain run."""
    plain, ours, theirs = _model(), _model(), _model()
    SPELLINGS[spelling](checkpointing, ours)  # type: ignore[arg-type]  # a module of the names
    SPELLINGS[spelling](torch_wrappers, theirs)  # type: ignore[arg-type]
    our_modules = [(n, type(m).__name__) for n, m in ours.named_modules()]
    assert our_modules == [(n, type(m).__name__) for n, m in theirs.named_modules()]
    assert any("Wrapper" in kind for _, kind in our_modules)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert list(ours.state_dict()) == list(theirs.state_dict()) == list(plain.state_dict())
    assert _kept_bytes(ours) == _kept_bytes(theirs)
    want = _grads(plain)
    offloads = "offload" in spelling.lower()
    their_want = _grads(_blocks_save_contiguous_copies(_model())) if offloads else want
    for got, exact in ((_grads(ours), want), (_grads(theirs), their_want)):
        assert len(got) == len(exact) == len(want)
        assert all(torch.equal(g, w) for g, w in zip(got, exact, strict=True))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)  # float64 defaults: rtol 1e-7, atol 1e-7


@pytest.mark.parametrize("name", ["CheckpointWrapper", "OffloadWrapper"])
def test_torchs_isinstance_checks_accept_ours(name: str) -> None:
    """NOTE [Module wrapper], Rule 5: ours are instances of torch's classes (FSDP1's ``.module``
    tests ``ActivationWrapper``), and torch's are not instances of ours."""
    ours = getattr(checkpointing, name)(nn.Linear(2, 2))
    assert isinstance(ours, getattr(torch_wrappers, name))
    assert isinstance(ours, torch_wrappers.ActivationWrapper)
    assert isinstance(ours, checkpointing.ActivationWrapper)
    assert not isinstance(
        getattr(torch_wrappers, name)(nn.Linear(2, 2)), getattr(checkpointing, name)
    )


def test_a_checkpoint_saved_with_torchs_wrapper_loads_into_ours_and_back() -> None:
    """``torch.save`` of a model wrapped by torch loads strictly into ours, and ours into it."""
    theirs, ours = _model(), _model()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(1.0)
    torch_wrappers.apply_activation_checkpointing(theirs, check_fn=_is_block)
    checkpointing.apply_activation_checkpointing(ours, check_fn=_is_block)
    saved = io.BytesIO()
    torch.save(theirs.state_dict(), saved)
    saved.seek(0)
    ours.load_state_dict(torch.load(saved))
    for (k, v), (k2, v2) in zip(
        ours.state_dict().items(), theirs.state_dict().items(), strict=True
    ):
        assert k == k2
        assert torch.equal(v, v2)
    fresh = _model()
    torch_wrappers.apply_activation_checkpointing(fresh, check_fn=_is_block)
    fresh.load_state_dict(ours.state_dict())
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), ours.parameters(), strict=True)
    )


def test_checkpoint_fn_is_what_runs_with_its_options() -> None:
    """Rule 7: with ``checkpoint_fn``, that function runs on the module, with the options given
    and the call's keyword arguments (packed for ``REENTRANT``), as in torch."""
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def my_checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        calls.append((fn, args, kwargs))
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False)

    block = Block().double()
    x = X.clone().requires_grad_()
    for lib in (checkpointing, torch_wrappers):
        wrapped = lib.checkpoint_wrapper(block, checkpoint_fn=my_checkpoint, marker=1)
        wrapped(x, scale=2.0).sum().backward()
    (fn, args, kwargs), (their_fn, their_args, their_kwargs) = calls
    assert fn is their_fn is block
    assert args == their_args == (x,)
    assert kwargs == their_kwargs == {"marker": 1, "scale": 2.0}
    calls.clear()
    for lib in (checkpointing, torch_wrappers):
        wrapped = lib.checkpoint_wrapper(block, lib.CheckpointImpl.REENTRANT, my_checkpoint)
        wrapped(x, scale=2.0).sum().backward()
    (_, args, kwargs), (_, their_args, their_kwargs) = calls
    assert args == their_args == (x, 2.0)
    assert kwargs == their_kwargs == {}


def test_our_options_keep_working_through_torchs_spellings() -> None:
    """``use_reentrant``, ``context_fn`` and ``hooks_during_recompute`` go along with
    ``checkpoint_impl`` and ``auto_wrap_policy``; gradients equal the unwrapped model's."""
    plain, by_policy, by_impl = _model().eval(), _model().eval(), _model().eval()
    checkpointing.apply_activation_checkpointing(
        by_policy,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        context_fn=as_context_fn(save_matmuls()),
        hooks_during_recompute=True,
    )
    assert by_policy[0].hooks_during_recompute
    for i in (0, 2):
        by_impl[i] = checkpointing.checkpoint_wrapper(
            by_impl[i], checkpointing.CheckpointImpl.REENTRANT, use_reentrant=True
        )
    assert by_impl[0].checkpoint_options["use_reentrant"] is True
    want = _grads(plain)
    for model in (by_policy, by_impl):
        assert all(torch.equal(g, w) for g, w in zip(_grads(model), want, strict=True))


def test_policy_sees_torchs_arguments_in_torchs_order() -> None:
    """NOTE [Applied wrappers], Rule 1: a callable policy gets the calls torch's FSDP wrapping
    makes (module, recurse, nonwrapped_numel), in the same order."""
    seen: dict[str, list[tuple[str, bool, int]]] = {"ours": [], "theirs": []}

    def recording(who: str) -> Callable[..., bool]:
        def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
            seen[who].append((type(module).__name__, recurse, nonwrapped_numel))
            return recurse or isinstance(module, nn.Linear)

        return policy

    checkpointing.apply_activation_checkpointing(_model(), auto_wrap_policy=recording("ours"))
    torch_wrappers.apply_activation_checkpointing(_model(), auto_wrap_policy=recording("theirs"))
    assert seen["ours"] == seen["theirs"]
    assert ("Linear", False, 84) in seen["ours"]


def test_bad_wrapper_arguments_say_which_api_and_the_fix() -> None:
    """Rule 6 and NOTE [Applied wrappers], Rule 3: a ``checkpoint_impl`` that is not a
    ``CheckpointImpl``, conflicting variants, an unknown option, a bad policy or
    ``checkpoint_fn``: each error names the function that received it and the fix."""
    linear = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="checkpoint_wrapper: 'checkpoint_impl' must be a Check"):
        checkpointing.checkpoint_wrapper(linear, "REENTRANT")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CheckpointWrapper: 'checkpoint_impl' must be a Check"):
        checkpointing.CheckpointWrapper(linear, checkpoint_impl=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="REENTRANT and use_reentrant=False ask for different"):
        checkpointing.checkpoint_wrapper(
            linear, checkpointing.CheckpointImpl.REENTRANT, use_reentrant=False
        )
    with pytest.raises(TypeError, match=r"apply_activation_checkpointing: unknown .*'early_st"):
        checkpointing.apply_activation_checkpointing(_model(), early_stopping=False)
    with pytest.raises(TypeError, match="checkpoint_fn must be a checkpoint function"):
        checkpointing.checkpoint_wrapper(linear, checkpoint_fn=42)  # type: ignore[arg-type]
    for lib in (checkpointing, torch_wrappers):  # torch raises ValueError too
        with pytest.raises(ValueError, match="callable"):
            lib.apply_activation_checkpointing(_model(), auto_wrap_policy=42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ModuleWrapPolicy"):
        checkpointing.apply_activation_checkpointing(_model(), auto_wrap_policy=42)  # type: ignore[arg-type]


def test_offload_wrapper_refuses_a_saved_tensor_changed_in_place() -> None:
    """NOTE [Saved on host], Rule 2: a host tensor kept as an alias and changed in place before
    backward raises autograd's in-place error (not silently wrong gradients)."""
    wrapped = checkpointing.offload_wrapper(nn.Sequential(nn.Linear(3, 3), nn.Tanh()))
    out = wrapped(torch.randn(2, 3, requires_grad=True))
    loss = out.sum()
    with torch.no_grad():
        out.add_(1.0)  # tanh saved its output
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


_FULLY_SHARD_AND_DCP = """
import os, torch, torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrappers
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard
import checkpointing

os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", "{port}"
dist.init_process_group("gloo", rank=0, world_size=1)
results = []
for lib in (torch_wrappers, checkpointing):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0] = lib.checkpoint_wrapper(model[0])
    keys = sorted(get_model_state_dict(model))
    fully_shard(model[0])
    fully_shard(model)
    model(torch.ones(3, 4)).sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    results.append((keys, sorted(model.state_dict()), sorted(get_model_state_dict(model)), grads))
dist.destroy_process_group()
(keys, sd, dcp, grads), (keys2, sd2, dcp2, grads2) = results
assert keys == keys2 == sd == sd2 == dcp == dcp2 == ["0.bias", "0.weight", "2.bias", "2.weight"]
assert all(torch.equal(a, b) for a, b in zip(grads, grads2, strict=True))
print("OK")
"""


@pytest.mark.slow
def test_fully_shard_and_dcp_state_dict_after_wrapping_as_torchs() -> None:
    """On a 1-process gloo group: DCP's ``get_model_state_dict`` and ``fully_shard`` after our
    wrapper give torch's wrapper's keys and gradients (in a fresh process: the group is global)."""
    code = textwrap.dedent(_FULLY_SHARD_AND_DCP.format(port=free_port()))
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("OK")


def test_offload_wrapper_goes_through_the_offload_engine() -> None:
    """``offload_wrapper`` sends what its module saves through the offload engine (over the fake
    device of ``offload_support``: side-stream copies, one prefetch group per call) and gets
    the unwrapped model's gradients, bitwise, with dropout."""
    backend = FakeBackend()
    engine = _offload.Engine(backend, prefetch_bytes=1 << 30, pool_bytes=1 << 20)
    plain, ours = _model(), _model()
    checkpointing.apply_activation_checkpointing(
        ours, checkpoint_wrapper_fn=checkpointing.offload_wrapper, check_fn=_is_block
    )
    with _offload.installed(engine):
        got = _grads(ours)
        backend.run_all()
    copies = [entry for entry in backend.log if entry[0] == "d2h issued"]
    restores = [entry for entry in backend.log if entry[0] == "h2d issued"]
    assert len(copies) >= 8  # each block saves its input, tanh's output, the mask, ...
    assert len(restores) == len(copies)
    assert not backend.violations
    assert all(torch.equal(g, w) for g, w in zip(got, _grads(plain), strict=True))


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("user error mid-forward")


@pytest.mark.parametrize("wrap", ["checkpoint_wrapper", "offload_wrapper"])
def test_wrappers_under_attack_threads_and_errors_mid_forward(wrap: str) -> None:
    """An error inside the wrapped module leaves no saved-tensors hook behind; one wrapped
    model stepped in four threads at once gives the unwrapped model's gradients in each."""
    failing = getattr(checkpointing, wrap)(nn.Sequential(nn.Linear(6, 6), _Fails()))
    with pytest.raises(ValueError, match="user error mid-forward"):
        failing(torch.randn(2, 6, requires_grad=True))
    assert _compat.top_saved_tensors_hooks() is None
    plain, ours = _model().eval(), _model().eval()  # no dropout: threads share the RNG
    checkpointing.apply_activation_checkpointing(
        ours, checkpoint_wrapper_fn=getattr(checkpointing, wrap), check_fn=_is_block
    )
    want = torch.autograd.grad(plain(X).pow(2).sum(), list(plain.parameters()))

    def step(index: int) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(ours(X).pow(2).sum(), list(ours.parameters()))

    for got in run_threads(step, 4):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
