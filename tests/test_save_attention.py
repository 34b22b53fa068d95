"""``policies.save_attention()`` and ``policies.ATTENTION_OPS``: "save attention, recompute the
rest" on every device's fused attention kernel.

On CPU, ``scaled_dot_product_attention`` runs ``_scaled_dot_product_flash_attention_for_cpu``;
``tests/test_cuda.py`` runs the CUDA kernels when a GPU is lent.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from frame_support import assert_tensors_equal, counting_ops, leaf

import checkpointing
from checkpointing.policies import (
    ATTENTION_OPS,
    MATMUL_OPS,
    as_context_fn,
    save_attention,
    save_nothing,
)

aten = torch.ops.aten
_CPU_KERNEL = aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_NAME = "_scaled_dot_product_flash_attention_for_cpu"  # as the report names it


def _sdpa_kernels_of_this_release() -> set[object]:
    """Every overload of an aten ``_scaled_dot_product_*`` forward op this torch registers that
    a dispatch mode can see (not composite: those decompose before)."""
    composite = torch.DispatchKey.CompositeImplicitAutograd
    found: set[object] = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        name, _, overload = qualified.partition(".")
        if not name.startswith("aten::_scaled_dot_product_") or name.endswith("_backward"):
            continue
        op = getattr(getattr(aten, name.removeprefix("aten::")), overload or "default")
        if not op.has_kernel_for_dispatch_key(composite):
            found.add(op)
    return found


def test_attention_ops_are_every_sdpa_kernel_of_this_release() -> None:
    """``ATTENTION_OPS`` is every fused SDPA kernel registered in this release (CPU, flash,
    efficient, cuDNN, MPS, overrideable), and no composite op that a policy could never see."""
    assert _sdpa_kernels_of_this_release() == ATTENTION_OPS
    assert _CPU_KERNEL in ATTENTION_OPS
    assert aten._scaled_dot_product_efficient_attention.default in ATTENTION_OPS
    assert aten.scaled_dot_product_attention.default not in ATTENTION_OPS
    assert aten._scaled_dot_product_attention_math.default not in ATTENTION_OPS
    assert ATTENTION_OPS <= MATMUL_OPS


def _attention(q: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.sin(), q.cos(), q, is_causal=True).tanh()


def test_save_attention_keeps_the_cpu_attention_output() -> None:
    """The attention output is kept (its bytes in the report, the kernel not run again in
    backward); the gradients equal the plain run and torch's SAC keeping the same ops."""
    q = leaf(2, 2, 8, 4, dtype=torch.float32, seed=3)
    with checkpointing.saved_tensors_report() as report:
        out = checkpointing.checkpoint(
            _attention, q, use_reentrant=False, context_fn=as_context_fn(save_attention())
        )
        with counting_ops() as counts:
            out.sum().backward()
    ours, q.grad = q.grad, None
    kept = [r for r in report.records if r.op == _CPU_NAME and r.decision == "saved"]
    output_bytes = q.numel() * q.element_size()
    assert tuple(q.shape) in [r.shape for r in kept]  # the attention output itself
    assert sum(r.nbytes for r in kept) >= output_bytes
    assert counts[str(_CPU_KERNEL)] == 0
    with checkpointing.saved_tensors_report() as nothing:
        checkpointing.checkpoint(
            _attention,
            leaf(2, 2, 8, 4, dtype=torch.float32, seed=3),
            use_reentrant=False,
            context_fn=as_context_fn(save_nothing()),
        ).sum().backward()
    assert report.kept_bytes - nothing.kept_bytes >= output_bytes
    _attention(q).sum().backward()
    plain, q.grad = q.grad, None
    assert_tensors_equal((ours,), (plain,))
    torch_context = functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts, sorted(ATTENTION_OPS, key=str)
    )
    torch_checkpoint.checkpoint(
        _attention, q, use_reentrant=False, context_fn=torch_context
    ).sum().backward()
    assert_tensors_equal((ours,), (q.grad,))


def test_save_attention_repr_and_answers() -> None:
    """It reads like the code and answers MUST_SAVE for the kernels, PREFER_RECOMPUTE else."""
    policy = save_attention()
    assert repr(policy) == "save_attention()"
    assert policy(None, _CPU_KERNEL) is checkpointing.CheckpointPolicy.MUST_SAVE
    assert policy(None, aten.mm.default) is checkpointing.CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
def test_save_attention_keeps_each_cuda_kernel(backend: str) -> None:
    """Each CUDA backend of SDPA runs a kernel of ``ATTENTION_OPS``, which ``save_attention()``
    keeps (backward runs no attention forward); gradients match the plain run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.float16, generator=gen)
    q.requires_grad_()
    with sdpa_kernel(getattr(SDPBackend, backend)):
        try:
            with counting_ops() as forward_ops:
                out = checkpointing.checkpoint(
                    _attention, q, use_reentrant=False, context_fn=as_context_fn(save_attention())
                )
        except RuntimeError as error:  # this GPU or build has no such kernel for these inputs
            pytest.skip(f"{backend}: {error}")
        with counting_ops() as backward_ops:
            out.float().sum().backward()
        ours, q.grad = q.grad, None
        _attention(q).float().sum().backward()
    ran = [op for op in ATTENTION_OPS if forward_ops[str(op)]]
    assert len(ran) == 1, forward_ops
    assert backward_ops[str(ran[0])] == 0
    torch.testing.assert_close(ours, q.grad)
