"""Shared Hypothesis strategies: random layer stacks and the inputs that go with them.

A drawn ``StackSpec`` is a plain description (layer kinds, widths, dtype, batch, seed); ``build``
turns it into modules deterministically from the drawn seed without touching the caller's RNG, so
two builds of one spec are identical and a test can run the same model with and without
checkpointing. Add new strategies at the end; do not change the existing ones (other tests rely on
what they draw).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.utils.checkpoint as torch_checkpoint
from hypothesis import strategies as st
from torch import nn

from checkpointing import policies
from checkpointing._planning.solve.problem import Problem, RegionChoices, Unit
from checkpointing._selective import CheckpointPolicy

LayerKind = Literal["linear", "relu", "gelu", "tanh", "silu", "layernorm", "dropout"]

ACTIVATIONS: tuple[LayerKind, ...] = ("relu", "gelu", "tanh", "silu")
DETERMINISTIC_KINDS: tuple[LayerKind, ...] = ("linear", *ACTIVATIONS, "layernorm")
ALL_KINDS: tuple[LayerKind, ...] = (*DETERMINISTIC_KINDS, "dropout")
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)

MIN_WIDTH, MAX_WIDTH = 2, 32
MIN_DEPTH, MAX_DEPTH = 1, 8


@dataclass(frozen=True)
class LayerSpec:
    """One layer: its kind, its output width, and (for dropout) its probability."""

    kind: LayerKind
    width: int
    p: float = 0.0


@dataclass(frozen=True)
class StackSpec:
    """A random stack of layers, with everything needed to rebuild it and feed it."""

    in_width: int
    layers: tuple[LayerSpec, ...]
    dtype: torch.dtype
    batch: int
    seed: int

    @property
    def depth(self) -> int:
        """Number of layers (the functions ``checkpoint_sequential`` sees)."""
        return len(self.layers)

    @property
    def has_dropout(self) -> bool:
        """Whether any layer draws random numbers in training mode."""
        return any(layer.kind == "dropout" and layer.p > 0 for layer in self.layers)

    def build(self) -> nn.Sequential:
        """The modules of this spec, initialised from ``seed`` (the caller's RNG is untouched)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            width = self.in_width
            modules: list[nn.Module] = []
            for layer in self.layers:
                modules.append(_make_layer(layer, width))
                width = layer.width
            model = nn.Sequential(*modules).to(self.dtype)
        return model.train()

    def make_input(self, requires_grad: bool = True) -> torch.Tensor:
        """A ``(batch, in_width)`` input drawn from ``seed + 1`` (the caller's RNG is untouched)."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        x = torch.randn(self.batch, self.in_width, generator=gen, dtype=self.dtype)
        return x.requires_grad_(requires_grad)

    def run(
        self,
        forward: Callable[[nn.Sequential, torch.Tensor], torch.Tensor],
        *,
        input_requires_grad: bool = True,
    ) -> StepResult:
        """Build a fresh model, run ``forward(model, x)`` and a backward with a fixed cotangent."""
        model = self.build()
        x = self.make_input(input_requires_grad)
        out = forward(model, x)
        gen = torch.Generator().manual_seed(self.seed + 2)
        cotangent = torch.randn(out.shape, generator=gen, dtype=out.dtype)
        out.backward(cotangent)
        return StepResult(
            out.detach(), x.grad, tuple(p.grad for p in model.parameters()), torch.get_rng_state()
        )


@dataclass(frozen=True)
class StepResult:
    """What one forward/backward step produced, and the CPU RNG state right after it."""

    output: torch.Tensor
    input_grad: torch.Tensor | None
    param_grads: tuple[torch.Tensor | None, ...]
    rng_after: torch.Tensor

    def gradients(self) -> tuple[torch.Tensor | None, ...]:
        """The input gradient followed by every parameter gradient."""
        return (self.input_grad, *self.param_grads)

    def assert_equal(self, other: StepResult) -> None:
        """Outputs and gradients bit-identical (``torch.equal``), ``None`` where the other is."""
        assert torch.equal(self.output, other.output), "outputs differ"
        mine, theirs = self.gradients(), other.gradients()
        assert len(mine) == len(theirs)
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert (a is None) == (b is None), f"gradient {i}: {a} vs {b}"
            if a is not None and b is not None:
                assert torch.equal(a, b), f"gradient {i} differs: max |diff| {(a - b).abs().max()}"


def _make_layer(layer: LayerSpec, in_width: int) -> nn.Module:
    if layer.kind == "linear":
        return nn.Linear(in_width, layer.width)
    if layer.kind == "layernorm":
        ln = nn.LayerNorm(in_width)
        # Non-trivial affine parameters, so their gradients say something.
        with torch.no_grad():
            ln.weight.normal_()
            ln.bias.normal_()
        return ln
    if layer.kind == "dropout":
        return nn.Dropout(layer.p)
    return {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}[layer.kind]()


@st.composite
def layer_stacks(
    draw: st.DrawFn,
    *,
    kinds: tuple[LayerKind, ...] = DETERMINISTIC_KINDS,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    min_depth: int = MIN_DEPTH,
    max_depth: int = MAX_DEPTH,
) -> StackSpec:
    """A random stack of ``kinds`` layers (widths 2..32, depths as given) in one of ``dtypes``."""
    in_width = draw(st.integers(MIN_WIDTH, MAX_WIDTH))
    depth = draw(st.integers(min_depth, max_depth))
    layers: list[LayerSpec] = []
    width = in_width
    for _ in range(depth):
        kind = draw(st.sampled_from(kinds))
        if kind == "linear":
            width = draw(st.integers(MIN_WIDTH, MAX_WIDTH))
        p = draw(st.sampled_from((0.1, 0.5))) if kind == "dropout" else 0.0
        layers.append(LayerSpec(kind, width, p))
    return StackSpec(
        in_width=in_width,
        layers=tuple(layers),
        dtype=draw(st.sampled_from(dtypes)),
        batch=draw(st.integers(1, 8)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def layer_stacks_with_dropout(
    draw: st.DrawFn, *, dtypes: tuple[torch.dtype, ...] = DTYPES
) -> StackSpec:
    """A random stack that contains at least one dropout layer (so the region draws RNG)."""
    spec = draw(layer_stacks(kinds=ALL_KINDS, dtypes=dtypes, max_depth=MAX_DEPTH - 1))
    at = draw(st.integers(0, spec.depth))
    width = spec.layers[at - 1].width if at > 0 else spec.in_width
    dropout = LayerSpec("dropout", width, draw(st.sampled_from((0.1, 0.5))))
    return StackSpec(
        in_width=spec.in_width,
        layers=(*spec.layers[:at], dropout, *spec.layers[at:]),
        dtype=spec.dtype,
        batch=spec.batch,
        seed=spec.seed,
    )


@st.composite
def stacks_and_segments(
    draw: st.DrawFn, stacks: st.SearchStrategy[StackSpec] | None = None
) -> tuple[StackSpec, int]:
    """A stack and a valid segment count for ``checkpoint_sequential`` (1..depth)."""
    spec = draw(stacks if stacks is not None else layer_stacks())
    return spec, draw(st.integers(1, spec.depth))


def segment_counts(max_functions: int = 12) -> st.SearchStrategy[tuple[int, int]]:
    """``(n_functions, segments)`` pairs with ``1 <= segments <= n_functions <= max_functions``."""
    return st.integers(1, max_functions).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n)))


# ---------------------------------------------------------------------------------------------
# Random op programs with checkpoints nested at random places (non-reentrant frame tests)
# ---------------------------------------------------------------------------------------------

OpName = Literal[
    "sin",
    "tanh",
    "sigmoid",
    "relu",
    "softmax",
    "mul_w",
    "add_w",
    "matmul_w",
    "center",
    "add_column_sums",
    "mix_detached",
    "dropout",
]
PROGRAM_OPS: tuple[OpName, ...] = get_args(OpName)


@dataclass(frozen=True)
class ProgramOp:
    """One op of a program: maps the running tensor ``h`` (and the weight ``w``) to a new ``h``."""

    name: OpName

    def apply(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Run this op (elementwise, matmul or reduction; dropout draws from the CPU RNG)."""
        name = self.name
        if name in ("sin", "tanh", "sigmoid", "relu"):
            return getattr(h, name)()  # type: ignore[no-any-return]
        if name == "softmax":
            return h.softmax(-1)
        if name == "mul_w":
            return h * w
        if name == "add_w":
            return h + w
        if name == "matmul_w":
            return (h @ w) / w.shape[0] ** 0.5
        if name == "center":
            return h - h.mean(dim=-1, keepdim=True)
        if name == "add_column_sums":
            return h + h.sum(dim=0, keepdim=True)
        if name == "mix_detached":
            return h * h.detach().cos()
        return torch.nn.functional.dropout(h, p=0.5, training=True)


@dataclass(frozen=True)
class ProgramRegion:
    """A checkpointed region (``checkpoint(body, h, w, early_stop=...)``) around a sub-program."""

    body: tuple[ProgramOp | ProgramRegion, ...]
    early_stop: bool


ProgramNode = ProgramOp | ProgramRegion


@dataclass(frozen=True)
class OpProgram:
    """A sequence of ops and nested checkpointed regions over one ``(n, n)`` float64 state."""

    nodes: tuple[ProgramNode, ...]
    n: int
    seed: int

    def run(
        self, h: torch.Tensor, w: torch.Tensor, checkpoint: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        """Interpret the program; ``checkpoint(fn, h, w, early_stop=...)`` wraps each region."""
        return _run_nodes(self.nodes, h, w, checkpoint)

    def depth(self) -> int:
        """How deeply regions nest (0: no region)."""
        return _depth(self.nodes)


def _run_nodes(
    nodes: tuple[ProgramNode, ...],
    h: torch.Tensor,
    w: torch.Tensor,
    checkpoint: Callable[..., torch.Tensor],
) -> torch.Tensor:
    for node in nodes:
        if isinstance(node, ProgramOp):
            h = node.apply(h, w)
        else:
            body = node.body

            def region(
                h: torch.Tensor, w: torch.Tensor, body: tuple[ProgramNode, ...] = body
            ) -> torch.Tensor:
                return _run_nodes(body, h, w, checkpoint)

            h = checkpoint(region, h, w, early_stop=node.early_stop)
    return h


def _depth(nodes: tuple[ProgramNode, ...]) -> int:
    return max(
        (1 + _depth(node.body) for node in nodes if isinstance(node, ProgramRegion)), default=0
    )


def program_nodes(max_leaves: int = 10) -> st.SearchStrategy[ProgramNode]:
    """An op, or a region (early stop on or off) around 1..4 nodes, nested to any depth."""
    ops = st.builds(ProgramOp, st.sampled_from(PROGRAM_OPS))
    return st.recursive(
        ops,
        lambda children: st.builds(
            ProgramRegion, st.lists(children, min_size=1, max_size=4).map(tuple), st.booleans()
        ),
        max_leaves=max_leaves,
    )


@st.composite
def op_programs(draw: st.DrawFn, *, min_depth: int = 1, max_leaves: int = 10) -> OpProgram:
    """A random program with regions nested at least ``min_depth`` deep (wrapped to get there)."""
    nodes = tuple(draw(st.lists(program_nodes(max_leaves), min_size=1, max_size=4)))
    while _depth(nodes) < min_depth:
        nodes = (ProgramRegion(nodes, draw(st.booleans())),)
    return OpProgram(nodes, n=draw(st.integers(2, 4)), seed=draw(st.integers(0, 2**31 - 1)))


# --- Selective checkpointing: op chains and random policies (tests/test_selective.py) ---------

SacStep = Literal[
    "matmul",
    "addmm",
    "bmm",
    "relu",
    "sin",
    "sigmoid",
    "mul_self",
    "add_input",
    "transpose",
    "chunk_cat",
    "max_dim",
    "softmax",
    "tag",
    "rand_mul",
]
SAC_STEPS: tuple[SacStep, ...] = get_args(SacStep)


@dataclass(frozen=True)
class SacChain:
    """A chain of square ops on an ``(n, n)`` float64 tensor with one ``(n, n)`` weight.

    The steps cover matrix products (mm, addmm, bmm), elementwise ops, views, multi-output ops
    (``chunk`` and ``max`` along a dim), ``checkpointing.policies.tag`` and a random op
    (``rand_mul`` draws from the CPU generator: seed it before each run you compare), so that a
    policy meets every kind of output the selective cache handles.
    """

    steps: tuple[SacStep, ...]
    n: int
    seed: int

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh ``(x, w)`` leaves drawn from ``seed`` (the caller's RNG is untouched)."""
        gen = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.n, self.n, generator=gen, dtype=torch.float64)
        w = torch.randn(self.n, self.n, generator=gen, dtype=torch.float64) / self.n
        return x.requires_grad_(), w.requires_grad_()

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Run the chain (the function a test checkpoints)."""
        h = x
        for i, step in enumerate(self.steps):
            if step == "matmul":
                h = h @ w
            elif step == "addmm":
                h = torch.addmm(x, h, w)
            elif step == "bmm":
                h = torch.bmm(h.unsqueeze(0), w.unsqueeze(0)).squeeze(0)
            elif step in ("relu", "sin", "sigmoid"):
                h = getattr(h, step)()
            elif step == "mul_self":
                h = h * h
            elif step == "add_input":
                h = h + x
            elif step == "transpose":
                h = h.t()
            elif step == "chunk_cat":
                h = torch.cat(h.chunk(2, dim=1)[::-1], dim=1)
            elif step == "max_dim":
                h = h + h.max(dim=1, keepdim=True).values
            elif step == "softmax":
                h = h.softmax(-1)
            elif step == "rand_mul":
                h = h * torch.rand_like(h)
            else:
                h = policies.tag(h, f"t{i % 3}")
        return h


@st.composite
def sac_chains(
    draw: st.DrawFn,
    *,
    kinds: tuple[SacStep, ...] = SAC_STEPS,
    min_steps: int = 1,
    max_steps: int = 10,
) -> SacChain:
    """A random ``SacChain`` of 1..10 steps (of ``kinds``) on a 2..6 square tensor."""
    steps = draw(st.lists(st.sampled_from(kinds), min_size=min_steps, max_size=max_steps))
    return SacChain(tuple(steps), n=draw(st.integers(2, 6)), seed=draw(st.integers(0, 2**31 - 1)))


def sac_answers(*, offload: bool = True) -> st.SearchStrategy[tuple[object, ...]]:
    """1..8 policy answers (``CheckpointPolicy`` members, torch's members, bools) that a
    ``ScriptedPolicy`` returns in turn; ``offload=False`` leaves out the offload values."""
    ours = [p for p in CheckpointPolicy if offload or "OFFLOAD" not in p.name]
    theirs = [p for p in torch_checkpoint.CheckpointPolicy if offload or "OFFLOAD" not in p.name]
    return st.lists(st.sampled_from([*ours, *theirs, True, False]), min_size=1, max_size=8).map(
        tuple
    )


# --- Scope API: random op graphs with gradient_checkpoint_scope blocks (test_scope_properties) ---

GraphOpName = Literal[
    "add",
    "mul",
    "sin",
    "tanh",
    "exp",
    "matmul",
    "sum",
    "mean",
    "t",
    "reshape",
    "slice",
    "dropout",
    "noise",
]
GRAPH_OPS: tuple[GraphOpName, ...] = get_args(GraphOpName)


@dataclass(frozen=True)
class GraphStep:
    """One op of a ``ScopedGraph``: reads pool tensors ``a`` and ``b`` (indices taken modulo the
    pool size) and appends its ``(n, n)`` result to the pool; ``p`` is the dropout probability."""

    op: GraphOpName
    a: int
    b: int
    p: float = 0.0

    def apply(self, pool: list[torch.Tensor]) -> torch.Tensor:
        """Run the op on the pool (random ops draw from the CPU RNG)."""
        a, b = pool[self.a % len(pool)], pool[self.b % len(pool)]
        op = self.op
        if op == "add":
            return a + b
        if op == "mul":
            return a * b
        if op in ("sin", "tanh"):
            return getattr(a, op)()  # type: ignore[no-any-return]
        if op == "exp":
            return a.clamp(-3.0, 3.0).exp()
        if op == "matmul":
            return (a @ b) / a.shape[0]
        if op == "sum":
            return a + a.sum(dim=0, keepdim=True)
        if op == "mean":
            return a * a.mean()
        if op == "t":
            return a.t()
        if op == "reshape":
            return a.reshape(-1).reshape(a.shape)
        if op == "slice":  # multiplies row slices (views, saved by mul), keeps the other rows
            return torch.cat((a[:1] * b[:1], a[1:]), dim=0)
        if op == "dropout":  # p=0 hands back ``a`` itself, the same object
            return torch.nn.functional.dropout(a, self.p, training=True)
        return a + torch.randn_like(a)


@dataclass(frozen=True)
class ScopedGraph:
    """A random program of ``GraphStep``s over two ``(n, n)`` float64 leaves ``x`` and ``w``,
    with scope blocks: ``blocks`` are ``[start, stop)`` step ranges, disjoint or nested, that run
    inside a scope (``run`` takes the scope factory, so the same graph runs without one)."""

    steps: tuple[GraphStep, ...]
    blocks: tuple[tuple[int, int], ...]
    n: int
    seed: int

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh leaves ``x, w`` drawn from ``seed`` (the caller's RNG is untouched)."""
        gen = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.n, self.n, generator=gen, dtype=torch.float64)
        w = torch.randn(self.n, self.n, generator=gen, dtype=torch.float64)
        return x.requires_grad_(), w.requires_grad_()

    def run(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        scope: Callable[[], AbstractContextManager[object]],
    ) -> list[torch.Tensor]:
        """Run every step, entering ``scope()`` for each block; returns the pool ``[x, w, ...]``."""
        pool = [x, w]
        starts = sorted(self.blocks, key=lambda block: (block[0], -block[1]))  # outer first
        open_blocks: list[tuple[int, AbstractContextManager[object]]] = []
        for index in range(len(self.steps) + 1):
            while open_blocks and open_blocks[-1][0] == index:
                open_blocks.pop()[1].__exit__(None, None, None)
            for start, stop in starts:
                if start == index:
                    context = scope()
                    context.__enter__()
                    open_blocks.append((stop, context))
            while open_blocks and open_blocks[-1][0] == index:  # empty blocks
                open_blocks.pop()[1].__exit__(None, None, None)
            if index < len(self.steps):
                pool.append(self.steps[index].apply(pool))
        return pool

    def loss(self, pool: list[torch.Tensor]) -> torch.Tensor:
        """A scalar that uses every tensor the steps made, each times its own cotangent."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        total = torch.zeros((), dtype=torch.float64)
        for tensor in pool[2:]:
            cotangent = torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype)
            total = total + (tensor * cotangent).sum()
        return total


def graph_steps() -> st.SearchStrategy[GraphStep]:
    """One step of the graph menu, with operand indices and (for dropout) p in {0, 0.3}."""
    return st.builds(
        GraphStep,
        st.sampled_from(GRAPH_OPS),
        st.integers(0, 15),
        st.integers(0, 15),
        st.sampled_from((0.0, 0.3)),
    )


@st.composite
def scoped_graphs(draw: st.DrawFn, *, min_steps: int = 1, max_steps: int = 8) -> ScopedGraph:
    """A random ``ScopedGraph`` with one block, two blocks one after the other (both alive at
    once) or two nested blocks, at random step ranges (empty ones included)."""
    steps = tuple(draw(st.lists(graph_steps(), min_size=min_steps, max_size=max_steps)))
    cut = st.integers(0, len(steps))
    layout = draw(st.sampled_from(("one", "sequential", "nested")))
    if layout == "one":
        start, stop = sorted((draw(cut), draw(cut)))
        blocks: tuple[tuple[int, int], ...] = ((start, stop),)
    else:
        a, b, c, d = sorted(draw(cut) for _ in range(4))
        blocks = ((a, b), (c, d)) if layout == "sequential" else ((a, d), (b, c))
    n, seed = draw(st.integers(2, 4)), draw(st.integers(0, 2**31 - 1))
    return ScopedGraph(steps, blocks, n=n, seed=seed)


@st.composite
def planner_problems(
    draw: st.DrawFn, *, max_regions: int = 3, max_units: int = 3, joins: bool = False
) -> Problem:
    """A small ``checkpointing._planning.solve.problem.Problem``: 1-3 regions with 0-3 units each,
    storages of 1-8 "bytes"; region inputs may be the previous region's last unit output
    (a storage two regions keep, as in a chain of blocks), and some storages are kept outside
    every region. ``joins`` (NOTE [Planner solve], Rule S9): instead, each region returns an
    output of its own (made past its early stop, at a cost) that the next one receives and
    saves, beside a constant of its own; a region captures an RNG state (among its inputs where
    it draws), may be charged a frame, and be joinable to the one before it."""
    storage_bytes: dict[int, int] = {}

    def storage() -> int:
        key = len(storage_bytes)
        storage_bytes[key] = draw(st.integers(1, 8))
        return key

    regions = []
    previous: int | None = None
    for _ in range(draw(st.integers(1, max_regions))):
        if joins:
            regions.append(_joinable_region(draw, storage, previous, max_units))
            previous = storage()  # its output, the next region's input
            continue
        inputs = {previous} if previous is not None and draw(st.booleans()) else {storage()}
        units = tuple(
            Unit(("aten.mm.default", i), draw(st.integers(0, 5)) / 1000, (storage(),))
            for i in range(draw(st.integers(0, max_units)))
        )
        outputs = [s for u in units for s in u.storages]
        saved = set(inputs) | {s for s in outputs if draw(st.booleans())}
        forced = draw(st.integers(0, 3)) / 1000
        regions.append(RegionChoices(frozenset(saved), frozenset(inputs), forced, units))
        previous = outputs[-1] if outputs else None
    outside = frozenset(s for s in storage_bytes if draw(st.integers(0, 9)) == 0)
    return Problem(tuple(regions), storage_bytes, outside)


def _joinable_region(
    draw: st.DrawFn, storage: Callable[[], int], previous: int | None, max_units: int
) -> RegionChoices:
    """One region of ``planner_problems(joins=True)``."""
    boundary = frozenset() if previous is None else frozenset({previous})
    constant = frozenset({storage()}) if previous is None or draw(st.booleans()) else frozenset()
    states = frozenset({storage()})
    drew = draw(st.booleans())
    units = tuple(
        Unit(("aten.mm.default", i), draw(st.integers(0, 5)) / 1000, (storage(),))
        for i in range(draw(st.integers(0, max_units)))
    )
    saved = boundary | constant | {s for u in units for s in u.storages if draw(st.booleans())}
    return RegionChoices(
        frozenset(saved),
        boundary | constant | (states if drew else frozenset()),
        draw(st.integers(0, 3)) / 1000,
        units,
        frame_seconds=draw(st.integers(0, 2)) / 1000,
        joinable=previous is not None and draw(st.booleans()),
        boundary=boundary,
        states=states,
        drew=drew,
        rest_seconds=draw(st.integers(0, 3)) / 1000,
        rest_frame_seconds=draw(st.integers(0, 1)) / 1000,
    )


# --- Selective checkpointing: op-only policies (the fast path of test_selective.py) -----------

# The ops a ``SacChain`` runs (forward and backward of every step kind), plus the tag op.
SAC_CHAIN_OPS: tuple[torch._ops.OpOverload, ...] = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.relu.default,
    torch.ops.aten.sin.default,
    torch.ops.aten.sigmoid.default,
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.add.Tensor,
    torch.ops.aten.t.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.cat.default,
    torch.ops.aten.max.dim,
    torch.ops.aten._softmax.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.rand_like.default,
    torch.ops.checkpointing.tag.default,
)


@st.composite
def op_only_policies(draw: st.DrawFn, *, depth: int = 2) -> policies.Policy:
    """A policy built from ``checkpointing.policies``' op-only factories (each on a random
    subset of ``SAC_CHAIN_OPS``) and, up to ``depth`` levels, ``either``/``both`` of them."""
    ops = draw(st.lists(st.sampled_from(SAC_CHAIN_OPS), max_size=5, unique=True))
    leaves: list[Callable[[], policies.Policy]] = [
        policies.save_nothing,
        policies.save_everything,
        policies.save_matmuls,
        lambda: policies.save_ops(*ops),
        lambda: policies.recompute_ops(*ops),
        lambda: policies.offload_ops(*ops),
    ]
    if depth > 0 and draw(st.booleans()):
        combine = draw(st.sampled_from([policies.either, policies.both]))
        parts = draw(st.lists(op_only_policies(depth=depth - 1), min_size=1, max_size=3))
        return combine(*parts)
    return draw(st.sampled_from(leaves))()


# ---------------------------------------------------------------------------------------------
# checkpoint_sequential strategies (tests/test_sequential_strategies.py)
# ---------------------------------------------------------------------------------------------

SequentialStrategy = Literal["torch", "balanced", "sqrt", "log", "optimal"]
SEQUENTIAL_STRATEGIES: tuple[SequentialStrategy, ...] = (
    "torch",
    "balanced",
    "sqrt",
    "log",
    "optimal",
)


@st.composite
def stacks_and_strategies(
    draw: st.DrawFn, stacks: st.SearchStrategy[StackSpec] | None = None
) -> tuple[StackSpec, SequentialStrategy, int | None, float]:
    """A stack, a ``checkpoint_sequential`` strategy, its segments (``None`` where the strategy
    chooses) and, for ``"optimal"``, where the budget sits between the floor (0) and twice it."""
    spec = draw(stacks if stacks is not None else layer_stacks())
    strategy = draw(st.sampled_from(SEQUENTIAL_STRATEGIES))
    segments = draw(st.integers(1, spec.depth)) if strategy in ("torch", "balanced") else None
    return spec, strategy, segments, draw(st.floats(0.0, 1.0))


@st.composite
def unequal_chains(
    draw: st.DrawFn, *, min_depth: int = 2, max_depth: int = 12
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A chain of unequal layers: per layer, an output width (4..64) and a cost weight (1..20)."""
    depth = draw(st.integers(min_depth, max_depth))
    widths = draw(st.lists(st.integers(4, 64), min_size=depth, max_size=depth))
    weights = draw(st.lists(st.integers(1, 20), min_size=depth, max_size=depth))
    return tuple(widths), tuple(weights)
