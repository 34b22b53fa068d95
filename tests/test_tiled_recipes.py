"""The tiled recipes: ``tiled_lm_head_loss`` (NOTE [Tiled LM head]) and ``tiled_mlp`` /
``tiled_experts`` (NOTE [Tiled recipes]) on transformers' own blocks, against the untiled run.

The head's tolerance (Rule 3: autograd's arithmetic in another order): float32 gradients agree
with ``cross_entropy``'s to ``rtol=1e-5, atol=1e-6`` (``HEAD_TOL``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from frame_support import assert_tensors_equal, counting_ops
from torch import nn

import checkpointing
from checkpointing import Tiling

HEAD_TOL: dict[str, float] = {"rtol": 1e-5, "atol": 1e-6}


def _untiled_loss(
    hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, **options: Any
) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), **options)


def _head_grads(hidden: torch.Tensor, head: nn.Linear) -> list[torch.Tensor | None]:
    grads = [hidden.grad, head.weight.grad, head.bias.grad]
    hidden.grad = None
    head.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("chunks", [1, 3, 7])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_head_loss_and_gradients_match_cross_entropy(chunks: int, reduction: str) -> None:
    """Loss and the gradients of hidden states, weight and bias match the untiled
    ``cross_entropy`` over ``linear(...).float()``, with ignored tokens, for any chunking."""
    torch.manual_seed(0)
    head = nn.Linear(12, 50)
    hidden = torch.randn(2, 19, 12, requires_grad=True)
    labels = torch.randint(0, 50, (2, 19))
    labels[0, :9] = -100  # a chunk with no counted token: the divisor is global (Rule 1)
    loss = checkpointing.tiled_lm_head_loss(
        hidden, head, labels, chunks=chunks, reduction=reduction
    )
    loss.backward()
    got = _head_grads(hidden, head)
    expected_loss = _untiled_loss(hidden, head, labels, reduction=reduction)
    expected_loss.backward()
    torch.testing.assert_close(loss, expected_loss, **HEAD_TOL)
    for a, b in zip(got, _head_grads(hidden, head), strict=True):
        torch.testing.assert_close(a, b, **HEAD_TOL)


def test_head_takes_a_bare_weight_and_bfloat16() -> None:
    """A weight tensor (tied embeddings) in bfloat16: the loss is float32, as with
    ``.float()`` logits, and the gradients match to bfloat16 rounding."""
    torch.manual_seed(0)
    weight = torch.randn(40, 8, dtype=torch.bfloat16, requires_grad=True)
    hidden = torch.randn(3, 10, 8, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 40, (3, 10))
    loss = checkpointing.tiled_lm_head_loss(hidden, weight, labels, chunk_size=4)
    assert loss.dtype == torch.float32
    loss.backward()
    got = [hidden.grad, weight.grad]
    hidden.grad = weight.grad = None
    F.cross_entropy(F.linear(hidden, weight).float().reshape(-1, 40), labels.reshape(-1)).backward()
    for a, b in zip(got, [hidden.grad, weight.grad], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_head_inside_an_outer_checkpoint_runs_no_third_forward() -> None:
    """In a checkpointed final block (norm, then head and loss), the head runs its chunks in
    forward and once more in backward: the block's recompute stops at its saved inputs."""
    torch.manual_seed(0)
    head, norm = nn.Linear(8, 30, bias=False), nn.LayerNorm(8)
    hidden = torch.randn(2, 12, 8, requires_grad=True)
    labels = torch.randint(0, 30, (2, 12))

    def block(h: torch.Tensor) -> torch.Tensor:
        return checkpointing.tiled_lm_head_loss(norm(h), head, labels, chunks=4)

    with counting_ops() as counts:
        loss = checkpointing.checkpoint(block, hidden, use_reentrant=False)
        loss.backward()
    # 4 chunks of logits in forward; in backward 4 again, each chunk's hidden gradient (mm into
    # its rows) and the weight's (one mm, then addmm_ into it): 16 products, 20 with a third
    # forward. The norm runs twice: forward, and the block's recompute up to the head.
    products = ("aten.mm.default", "aten.mm.out", "aten.addmm_.default")
    assert sum(counts[name] for name in products) == 16, counts
    assert counts["aten.native_layer_norm.default"] == 2, counts
    got = [hidden.grad, head.weight.grad]
    hidden.grad = head.weight.grad = None
    _untiled_loss(norm(hidden), head, labels).backward()
    for a, b in zip(got, [hidden.grad, head.weight.grad], strict=True):
        torch.testing.assert_close(a, b, **HEAD_TOL)


def test_head_refuses_mismatched_shapes_and_reductions() -> None:
    """Shapes that do not fit and a per-token reduction are refused with the expected form."""
    head = nn.Linear(8, 30)
    with pytest.raises(ValueError, match="labels must have hidden's leading shape"):
        checkpointing.tiled_lm_head_loss(
            torch.randn(2, 5, 8), head, torch.zeros(2, 4, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        checkpointing.tiled_lm_head_loss(
            torch.randn(2, 5, 8), head, torch.zeros(2, 5, dtype=torch.long), reduction="none"
        )  # type: ignore[arg-type]


def test_head_under_no_grad_gives_the_loss() -> None:
    """Evaluation: the same loss, no graph."""
    head = nn.Linear(8, 30)
    hidden, labels = torch.randn(2, 9, 8), torch.randint(0, 30, (2, 9))
    with torch.no_grad():
        loss = checkpointing.tiled_lm_head_loss(hidden, head, labels, chunks=2)
        torch.testing.assert_close(loss, _untiled_loss(hidden, head, labels), **HEAD_TOL)
    assert loss.grad_fn is None


transformers = pytest.importorskip("transformers")


def _llama_mlp() -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=48, num_attention_heads=2, num_key_value_heads=2
    )
    return LlamaMLP(config)


def test_tiled_mlp_on_llamas_mlp_matches_the_chunkwise_and_untiled_runs() -> None:
    """``tiled_mlp`` on transformers' ``LlamaMLP``: input gradient bitwise the chunk-by-chunk
    plain run's, parameter gradients within the tolerance of the untiled run's."""
    torch.manual_seed(0)
    mlp = _llama_mlp()
    x = torch.randn(2, 20, 16, requires_grad=True)
    expected_x = torch.empty_like(x)
    for start, size in Tiling(dim=1, chunks=4).bounds(20):
        part = x.detach().narrow(1, start, size).requires_grad_()
        expected_x.narrow(1, start, size).copy_(torch.autograd.grad(mlp(part).sum(), part)[0])
    mlp(x).sum().backward()
    expected = [p.grad for p in mlp.parameters()]
    mlp.zero_grad(set_to_none=True)
    x.grad = None
    checkpointing.tiled_mlp(mlp, chunks=4)
    mlp(x).sum().backward()
    assert_tensors_equal([x.grad], [expected_x], "input gradient")
    for a, b in zip([p.grad for p in mlp.parameters()], expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tiled_mlp_refuses_llamas_attention() -> None:
    """Attention mixes positions: the recipe refuses it."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = transformers.LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(ValueError, match="mixes positions"):
        checkpointing.tiled_mlp(LlamaAttention(config, layer_idx=0), chunks=2)


def test_tiled_experts_on_mixtrals_experts_match_the_untiled_run() -> None:
    """``tiled_experts`` on transformers' ``MixtralExperts`` (routed tokens, top-2 routing
    computed outside): gradients of tokens, routing weights and experts match the untiled
    run; each chunk routes its own tokens."""
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    config = transformers.MixtralConfig(
        hidden_size=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2
    )
    torch.manual_seed(0)
    experts = mixtral.MixtralExperts(config)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.2)
    tokens = torch.randn(30, 8, requires_grad=True)
    logits = torch.randn(30, 4)
    weights, index = logits.softmax(-1).topk(2, dim=-1)
    weights = weights.detach().requires_grad_()
    experts(tokens, index, weights).square().sum().backward()
    expected = [tokens.grad, weights.grad] + [p.grad for p in experts.parameters()]
    tokens.grad = weights.grad = None
    experts.zero_grad(set_to_none=True)
    checkpointing.tiled_experts(experts, chunks=4)
    experts(tokens, index, weights).square().sum().backward()
    got = [tokens.grad, weights.grad] + [p.grad for p in experts.parameters()]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _tiny_causal_lm(cls: Any, **extra: Any) -> Any:
    config_cls = (
        transformers.MixtralConfig if "Mixtral" in cls.__name__ else transformers.LlamaConfig
    )
    config = config_cls(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        **extra,
    )
    torch.manual_seed(0)
    return cls(config).train()


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "MixtralForCausalLM"])
def test_enable_tile_mlp_tiles_each_layer_without_a_third_forward(name: str) -> None:
    """``enable(model, tile_mlp=4)``: every layer's MLP (Mixtral: its experts) is tiled, the
    layer's checkpoint does not re-run it (each chunk runs in forward and in backward only),
    the loss and gradients match the plain model's, and ``disable`` removes the tiling."""
    import checkpointing.integrations.transformers as hf_checkpointing

    cls = getattr(transformers, name)
    extra = {"num_local_experts": 4, "num_experts_per_tok": 2} if "Mixtral" in name else {}
    plain, model = _tiny_causal_lm(cls, **extra), _tiny_causal_lm(cls, **extra)
    ids = torch.randint(0, 32, (2, 12))
    expected_loss = plain(input_ids=ids, labels=ids).loss
    expected_loss.backward()
    hf_checkpointing.enable(model, tile_mlp=4)
    tiled = model.model.layers[0].mlp
    tiled = getattr(tiled, "experts", tiled)
    assert "forward" in tiled.__dict__
    calls: list[int] = []
    tiled.register_forward_hook(lambda *_: calls.append(1))  # the module's own call: once
    chunks: list[int] = []
    first = tiled.gate_proj if name.startswith("Llama") else None  # Mixtral: 3-D weights
    if first is not None:
        first.register_forward_hook(lambda m, i, o: chunks.append(i[0].shape[1]))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for (pname, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=pname)
    assert calls == [1]
    if first is not None:
        assert chunks == [3] * 8  # 4 chunks in forward, 4 in backward: no third forward
    hf_checkpointing.disable(model)
    assert "forward" not in tiled.__dict__


def test_enable_tile_mlp_is_checked() -> None:
    """A bad chunk count, and ``tile_mlp`` with ``budget``, are refused by ``enable``."""
    import checkpointing.integrations.transformers as hf_checkpointing

    model = _tiny_causal_lm(transformers.LlamaForCausalLM)
    with pytest.raises(ValueError, match="tile_mlp must be a number of chunks"):
        hf_checkpointing.enable(model, tile_mlp=0)
    with pytest.raises(ValueError, match="cannot be combined with budget"):
        hf_checkpointing.enable(model, budget=0.5, tile_mlp=2, example_kwargs={"input_ids": None})
