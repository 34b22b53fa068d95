"""Models and measurements shared by the planner's tests (``tests/test_planner*.py``).

The models are small versions of the benchmark's W1 (Linear+GELU blocks) and W2
(TransformerEncoderLayer with dropout), a tiny Llama-style decoder built from plain modules, an
MLP-mixer of many small regions that draw random numbers, and a post-norm encoder whose blocks
end in a norm. The measurements run one step the way every planner test compares runs: the same
seed, gradients of the parameters (and of the input where it requires grad), the report of what
was saved, and the bytes the CPU allocator holds.
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from allocator_support import allocator_step
from torch import nn

import checkpointing
from checkpointing import ActivationPlan
from checkpointing._planning import search as search_module
from checkpointing._planning.measure.flops import FlopCount
from checkpointing._planning.measure.profile import profile_step
from checkpointing._planning.solve.problem import (
    Choice,
    Problem,
    join_breaks,
    kept_bytes,
    recompute_flops,
    recompute_seconds,
)
from checkpointing._planning.solve.solver import solve

# --- models -------------------------------------------------------------------------------------


def mlp(depth: int = 6, width: int = 32) -> nn.Sequential:
    """W1, small: ``depth`` x (Linear + GELU)."""
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)))


def transformer(depth: int = 3) -> nn.Sequential:
    """W2, small: ``depth`` x TransformerEncoderLayer(32, 4 heads, dropout 0.1), training."""
    return nn.Sequential(
        *(
            nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.1, batch_first=True)
            for _ in range(depth)
        )
    ).train()


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    """Llama's block: RMSNorm, causal attention with RoPE, RMSNorm, SwiGLU MLP, residuals."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, 2 * dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attention.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    """Embedding, ``depth`` decoder layers (a ModuleList), final norm and LM head."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, heads) for _ in range(depth))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head_dim = dim // heads

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(run_layers(self.embed, self.layers, tokens, self.head_dim)))


def run_layers(
    embed: nn.Module, layers: nn.ModuleList, tokens: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """Embed ``tokens`` and run them through the decoder ``layers`` with rotary angles."""
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(tokens.shape[1]).float(), inv).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    x = embed(tokens)
    for layer in layers:
        x = layer(x, cos, sin)
    return x


def llama_loss(logits: torch.Tensor) -> torch.Tensor:
    """Next-token loss against fixed targets (the token ids shifted by one)."""
    targets = torch.arange(logits.shape[1]).remainder(logits.shape[-1]).expand(logits.shape[0], -1)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class MixerBlock(nn.Module):
    """An MLP-mixer block: token mixing, then channel mixing, each LayerNorm, MLP, dropout."""

    def __init__(self, tokens: int, channels: int, p: float = 0.1) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(channels), nn.LayerNorm(channels)
        self.tokens = nn.Sequential(
            nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens), nn.Dropout(p)
        )
        self.channels = nn.Sequential(
            nn.Linear(channels, 2 * channels),
            nn.GELU(),
            nn.Linear(2 * channels, channels),
            nn.Dropout(p),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


def mixer(depth: int = 10) -> nn.Sequential:
    """Many small regions that draw random numbers: each checkpointed one keeps its own ~5 KB
    CPU RNG state, a few percent of what it keeps otherwise."""
    return nn.Sequential(*(MixerBlock(16, 8) for _ in range(depth))).train()


class SpannedEncoder(nn.Module):
    """An embedding, three post-norm encoder blocks (dropout ``dropout``), a norm and a head:
    a W2-like model around which the head, tail and trail spans are all offered."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 4, 64, dropout=dropout, batch_first=True)
            for _ in range(3)
        )
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def encoder(norm_first: bool = False, depth: int = 3, width: int = 16) -> nn.Sequential:
    """Post-norm (``norm_first=False``, the default: each block ends in its ``norm2``) or
    pre-norm blocks, with dropout, the same weights every call."""
    torch.manual_seed(0)
    return nn.Sequential(
        *(
            nn.TransformerEncoderLayer(
                width, 2, 2 * width, dropout=0.1, batch_first=True, norm_first=norm_first
            )
            for _ in range(depth)
        )
    ).train()


def encoder_inputs(width: int = 16) -> torch.Tensor:
    """A batch of 2 sequences of 8 tokens for ``encoder``, the same every call."""
    return torch.randn(2, 8, width, generator=torch.Generator().manual_seed(1))


# --- one step, measured -------------------------------------------------------------------------


def loss_of(model: nn.Module, x: torch.Tensor, loss_fn: Callable | None) -> torch.Tensor:
    out = model(x)
    return out.sum() if loss_fn is None else loss_fn(out)


def grads_of(model: nn.Module, x: torch.Tensor, loss_fn: Callable | None, seed: int = 7):
    """Gradients of parameters (and of ``x`` if it requires grad) after one step."""
    torch.manual_seed(seed)
    wrt = [*model.parameters(), *([x] if x.requires_grad else [])]
    return torch.autograd.grad(loss_of(model, x, loss_fn), wrt)


def pickled_grads(plan: Any, model: nn.Module, x: torch.Tensor) -> Any:
    """Gradients of a pickled copy of ``model`` with ``plan`` applied (the model left as it
    was): what a plan's regions keep must survive ``torch.save``."""
    plan.apply(model)
    try:
        twin = pickle.loads(pickle.dumps(model))
        return grads_of(twin, x, None)
    finally:
        plan.remove(model)


def measured(model: nn.Module, x: torch.Tensor, loss_fn: Callable | None):
    """(report of one step, its gradients), with the same seed as ``grads_of``."""
    torch.manual_seed(7)
    wrt = [*model.parameters(), *([x] if x.requires_grad else [])]
    with checkpointing.saved_tensors_report() as report:
        grads = torch.autograd.grad(loss_of(model, x, loss_fn), wrt)
    return report, grads


def allocator_held(forward: Callable[[], torch.Tensor]) -> int:
    """Bytes the CPU allocator holds at the end of ``forward`` that it allocated during it, the
    returned loss aside (``benchmarks/_memory.py``'s "held"); backward then runs too."""
    return allocator_step(forward).held


def backward_flops(model: nn.Module, x: torch.Tensor, loss_fn: Any) -> int:
    """FLOPs of one step's backward (recompute included), gradients dropped."""
    torch.manual_seed(7)
    loss = loss_of(model, x, loss_fn)
    wrt = [p for p in model.parameters() if p.requires_grad]
    with FlopCount() as counter:
        torch.autograd.grad(loss, wrt)
    return counter.flops


# --- plans the tests choose ---------------------------------------------------------------------


Chooser = Callable[[Problem, int], Choice]


def forced_plan(model: nn.Module, x: torch.Tensor, choose: Chooser) -> ActivationPlan:
    """A plan of ``choose``'s choices (not the solver's) on the profiled model."""
    named = search_module.find_regions(model, None)
    profile = profile_step(model, named, (x,), {}, None)
    problem = profile.problem(0.0)
    choices = tuple(choose(problem, i) for i in range(len(problem.regions)))
    solution = dataclasses.replace(
        solve(problem, 0),
        choices=choices,
        kept_bytes=kept_bytes(problem, choices),
        recompute_seconds=recompute_seconds(problem, choices),
        recompute_flops=recompute_flops(problem, choices),
    )
    nothing = [frozenset[int]()] * len(choices)
    return ActivationPlan._from_solution(
        profile, problem, solution, solution.kept_bytes, nothing, "time"
    )


def draws_only(problem: Problem, index: int) -> Choice:
    return Choice(True, draws=problem.regions[index].draws is not None)


def draws_and_units(problem: Problem, index: int) -> Choice:
    """Draws kept, and every second unit: the draws' modes under the selective ones."""
    region = problem.regions[index]
    return Choice(True, frozenset(range(0, len(region.units), 2)), region.draws is not None)


# --- brute force over a problem's choices -------------------------------------------------------


def all_choices(problem: Problem):
    """Every choice of every region (brute force), joins included where the run can hold them
    (NOTE [Planner solve], Rule S9)."""
    per_region = []
    for index, region in enumerate(problem.regions):
        options = [Choice(False)]
        for size in range(len(region.units) + 1):
            options += [
                Choice(True, frozenset(s))
                for s in itertools.combinations(range(len(region.units)), size)
            ]
        if index and region.joinable:
            options.append(Choice(True, joined=True))
        per_region.append(options)
    return (c for c in itertools.product(*per_region) if not join_breaks(problem, c))


def least_per_budget(problem: Problem, measure: Callable[[Problem, Any], float]):
    """Per budget from the floor to the plain run's bytes: (budget, the least ``measure`` over
    every choice that fits it), by brute force."""
    choices = list(all_choices(problem))
    plain = kept_bytes(problem, [Choice(False)] * len(problem.regions))
    floor = solve(problem, plain).floor_bytes
    for budget in range(floor, plain + 1):
        fitting = (c for c in choices if kept_bytes(problem, c) <= budget)
        yield budget, min(measure(problem, c) for c in fitting)


def shared_storages(problem: Problem) -> bool:
    """Whether two regions may keep one storage (then the additive byte model overcounts)."""
    seen: set[int] = set()
    for region in problem.regions:
        mine = set(region.saved) | set(region.inputs)
        mine |= {s for u in region.units for s in u.storages}
        mine -= problem.outside
        if mine & seen:
            return True
        seen |= mine
    return False
