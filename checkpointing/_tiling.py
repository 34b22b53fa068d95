"""Sequence-tiled regions: a position-wise function run, and recomputed, one chunk at a time.

Owns ``Tiling`` (the declaration: along which dimension the region is position-wise, how many
chunks, which positional inputs are split), ``tiled`` (a function made a tiled region), the
autograd node that keeps a tiled region's inputs and re-runs it chunk by chunk in backward, the
position-wise probe of debug mode and the refusal of modules known to mix positions.
``checkpoint(..., tile=...)`` and ``checkpoint_module(module, tile=...)`` come here (through
``run_tiled`` and ``TiledForward``); one call's node and its chunk loops are ``_tiled_run``'s;
the recipes build on it (``_tiled_recipes``), except the
LM head and its loss, whose backward is written by hand (``_tiled_head``). Forward-time state
capture (RNG, autocast) is ``_state``'s.

NOTE [Tiled regions]
  Rule 1. A tiled region is a checkpoint of its own: its forward runs each chunk under no_grad
          and keeps nothing but its inputs; its backward re-runs one chunk at a time with grad
          and backpropagates that chunk's share of the output gradient at once. One chunk's
          graph is alive at a time, and each chunk is recomputed once per backward.
  Rule 2. Its inputs are saved (through the saved-tensors hooks active, e.g. an outer
          checkpoint's) before any chunk runs. An outer non-reentrant checkpoint whose recompute
          needs nothing saved after them stops right there (early stop, NOTE [Nestable
          checkpoint], Rule 5): the region is not run again by the outer recompute, and its own
          per-chunk recompute in backward is its only re-run. A tiled module patched into a
          checkpointed layer instead runs three times (forward, the layer's recompute, its own).
  Rule 3. Position-wise is the caller's declaration: ``out[..., i, ...]`` depends only on the
          inputs' ``[..., i, ...]`` along ``dim`` (counted per tensor; negative counts from the
          end). The positional inputs named by ``split`` are sliced; every other argument,
          tensors included, reaches every chunk whole. Every tensor output must have the
          chunk's length along ``dim``; it is written into one buffer of the full length.
  Rule 4. Gradients. A split input's gradient is the per-chunk gradients side by side: bitwise
          what the function run chunk by chunk in plain autograd gives, and what one untiled
          call gives wherever its kernels compute each position alone (elementwise ops); a
          matmul may block rows differently for another row count, so against one untiled call
          it agrees to rounding. Gradients of tensors not split (inputs reaching every chunk,
          parameters) are sums over the chunks in chunk order: they agree with the untiled run
          to the reduction-order tolerance (``tests/test_tiling.py`` states it).
  Rule 5. What the function differentiates must be declared: its positional tensor inputs and,
          for a module, its parameters. The first recomputed chunk's graph is walked, and a
          tensor requiring grad that is neither (a parameter read from a closure) is refused:
          its gradient would otherwise be lost. A parameter with ``register_hook`` hooks is
          refused when the region is called: each chunk's share of its gradient is computed
          apart, and the hooks would run on every share and again on the sum.
  Rule 6. Each chunk's forward state (RNG, autocast, device context) is captured before it runs
          and restored for its recompute (with ``preserve_rng_state``), so a chunk's recompute
          draws what its forward drew; the draws differ from an untiled run's (each chunk
          draws for its own shape).
  Rule 7. Mixing positions is refused where it is known (modules: attention, batch, instance
          and group norms, convolutions, recurrent layers) and detected in debug mode: the first
          two chunks are run together once more, and their rows must match the chunks run alone
          (a function that draws random numbers is not probed: its draws differ by shape).
  Rule 8. Keyword inputs reach every chunk; one that requires grad is refused (pass it as a
          positional input). Outputs are one tensor, or a tuple or list of tensors.
  Rule 10. The forward's chunks run inside a kept span's marker (NOTE [Kept spans], Rule 6):
          an outer region's selective policy (ours) neither caches nor counts their ops, which
          would otherwise keep every chunk's matmul outputs until backward. (Torch's own
          selective contexts do not honour the marker: under them the outputs are cached.)
  Rule 9. While dynamo traces, a tiled region is torch's checkpoint region, untiled (NOTE
          [Compiled regions]): the compiler's partitioner decides what the graph keeps.
  Rule 11. Gradients are added up as they are made. Each recompute runs under a torch function
          mode that hands every torch function a stand-in for each declared parameter (a leaf
          sharing its memory), and each chunk's backward is ``torch.autograd.backward(...,
          inputs=...)`` onto the stand-ins and the inputs' leaves: autograd adds a chunk's
          gradient of a weight into the running sum as soon as it is made and frees it, so
          backward holds the sums and at most one weight's chunk gradient, not the sums and
          every weight's chunk gradient (``torch.autograd.grad`` would keep all of a chunk's
          captured gradients until its call ends); a linear layer's weight has its chunks'
          gradients multiplied straight into its sum, with no chunk gradient of it at all (NOTE
          [Tiled gradient sums], ``_tiled_grads``). The mode is per thread: another thread
          using the module meanwhile reads its own parameters. The sums run in chunk order
          (Rule 4). A parameter reached past the mode (an
          ``autograd.Function`` given it directly: its ``apply`` is no torch function) is seen
          in chunk 0's graph; that backward then starts over with the parameters themselves as
          targets of ``torch.autograd.grad``, summed by hand (correct, with the higher peak).
  Rule 12. A chunk's recompute saves what its backward reads under hooks of its own that keep
          each tensor as it is: that graph lives and dies inside this backward, so an outer
          saved-tensors hook (a report's, an offload context's) would only move or count it
          for nothing; a report would read the saves as a reentrant checkpoint's re-run.

Rejected: accumulating parameter gradients into the parameters' ``.grad`` inside the backward
(what a tiled module written with ``torch.autograd.backward`` does): ``torch.autograd.grad``
would then see nothing and gradient hooks would fire once per chunk; the node returns the sums
its stand-ins gathered (Rule 11). Rejected too: swapping the stand-ins into the module's
parameters for the recompute: another thread's forward of the module would record the
stand-ins and its parameters' gradients would be lost.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Final

import torch
from torch import nn

from . import _compat, _compiled
from ._determinism import debug_enabled, metadata_fn_for
from ._errors import describe_value, internal_error
from ._options import CheckpointOptions, Tiling
from ._state import noop_context_fn
from ._tiled_gated import gated_mlp
from ._tiled_run import TiledNode, TiledRun

__all__ = [
    "TiledForward",
    "TiledFunction",
    "check_tile_options",
    "check_tiling",
    "module_parameters",
    "refuse_mixing",
    "run_tiled",
    "tiled",
]

_MSG_NOT_A_TILING = (
    "{api}: tile must be a checkpointing.Tiling, got {got}. Fix: tile=checkpointing.Tiling("
    "dim=1, chunks=8)."
)
_MSG_NOT_CALLABLE = (
    "checkpointing.tiled: expected a callable (the position-wise function or module), got "
    "{got}. Fix: checkpointing.tiled(layer.mlp, dim=1, chunks=8)."
)
_MSG_OPTION = (
    "{api}: {option} cannot be combined with tile=. A tiled region keeps nothing but its "
    "inputs and recomputes one chunk at a time; {why} Fix: drop {option}."
)
_MSG_MIXING_MODULE = (
    "{api}: {module} contains {child} ({kind}), which mixes positions, so it cannot be tiled "
    "along a sequence: each chunk would see only its own positions and the result would be "
    "wrong. Fix: tile only the position-wise part (the MLP, the experts, the LM head and "
    "loss), and checkpoint the rest untiled."
)


def tiled(
    function: Callable[..., Any],
    *,
    dim: int = 1,
    chunks: int | None = None,
    chunk_size: int | None = None,
    split: tuple[int, ...] = (0,),
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
) -> TiledFunction:
    """``function`` as a sequence-tiled checkpointed region (``Tiling(dim, chunks, ...)``).

    Each call runs ``function`` chunk by chunk along ``dim`` and keeps only its inputs; backward
    recomputes one chunk at a time (NOTE [Tiled regions]). ``function`` must be position-wise
    along ``dim``; an ``nn.Module`` has its parameters declared and is refused if it holds a
    layer that mixes positions; ``debug=True`` also probes the claim on every call.

    Example:
        >>> import torch, checkpointing
        >>> mlp = torch.nn.Sequential(
        ...     torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)
        ... )
        >>> run = checkpointing.tiled(mlp, dim=1, chunks=4)
        >>> x = torch.randn(2, 16, 8, requires_grad=True)
        >>> run(x).sum().backward()
    """
    tiling = Tiling(dim=dim, chunks=chunks, chunk_size=chunk_size, split=split)
    metadata_fn_for(determinism_check)  # a bad value raises now
    options = CheckpointOptions(
        use_reentrant=False,
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        debug=debug,
        tile=tiling,
    )
    return TiledFunction(function, options)


class TiledFunction:
    """What ``tiled`` returns: calling it runs one tiled region."""

    def __init__(self, function: Callable[..., Any], options: CheckpointOptions) -> None:
        if not callable(function):
            raise TypeError(_MSG_NOT_CALLABLE.format(got=describe_value(function)))
        self.function = function
        self.options = options  # its ``tile`` is the region's ``Tiling``
        functools.update_wrapper(self, function, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return run_tiled(self.function, args, kwargs, self.options, api="checkpointing.tiled")


# Modules whose output at one position reads other positions (Rule 7).
_MIXING: Final[tuple[tuple[type[nn.Module], str], ...]] = (
    (nn.MultiheadAttention, "attention"),
    (nn.modules.batchnorm._BatchNorm, "a norm over the batch and positions"),
    (nn.modules.instancenorm._InstanceNorm, "a norm over positions"),
    (nn.GroupNorm, "a norm over channels and positions"),
    (nn.modules.conv._ConvNd, "a convolution over neighbouring positions"),
    (nn.RNNBase, "a recurrent layer"),
    (nn.TransformerEncoderLayer, "attention"),
    (nn.TransformerDecoderLayer, "attention"),
)


def refuse_mixing(module: nn.Module, api: str) -> None:
    """Raise when ``module`` holds a layer known to mix positions (Rule 7); an ``...Attention``
    class (transformers' attention modules) counts as one."""
    for name, child in module.named_modules():
        kind = next((k for cls, k in _MIXING if isinstance(child, cls)), None)
        if kind is None and type(child).__name__.endswith("Attention"):
            kind = "attention"
        if kind is not None:
            raise ValueError(
                _MSG_MIXING_MODULE.format(
                    api=api,
                    module=type(module).__name__,
                    child=f"{name or 'itself'}: {type(child).__name__}",
                    kind=kind,
                )
            )


def check_tiling(tile: object, api: str) -> Tiling:
    """``tile``, or raise unless it is a ``Tiling``."""
    if not isinstance(tile, Tiling):
        raise TypeError(_MSG_NOT_A_TILING.format(api=api, got=describe_value(tile)))
    return tile


def check_tile_options(api: str, options: CheckpointOptions) -> None:
    """The checkpoint options that have no meaning for a tiled region are refused."""
    context_fn = None if options.context_fn is noop_context_fn else options.context_fn
    refused = (
        ("use_reentrant", options.use_reentrant, "the reentrant variant has no tiled form."),
        (
            "context_fn",
            context_fn,
            "a selective policy would keep nothing (no chunk's graph outlives it).",
        ),
        (
            "respect_saved_tensors_hooks",
            options.respect_saved_tensors_hooks,
            "it applies to what a selective policy keeps.",
        ),
        (
            "recompute_state_hooks",
            options.recompute_state_hooks,
            "user state is not restored per chunk.",
        ),
    )
    for option, value, why in refused:
        if value not in (None, False):
            raise ValueError(_MSG_OPTION.format(api=api, option=option, why=why))


def module_parameters(function: object) -> tuple[torch.Tensor, ...]:
    """The parameters a region declares: those of a module, or of a bound method's module."""
    owner = function if isinstance(function, nn.Module) else getattr(function, "__self__", None)
    if isinstance(owner, nn.Module):
        return tuple(p for p in owner.parameters() if p.requires_grad)
    return ()


def run_tiled(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: CheckpointOptions,
    *,
    params: tuple[torch.Tensor, ...] | None = None,
    api: str = "checkpointing.checkpoint",
) -> Any:
    """One call of a tiled region (NOTE [Tiled regions]) declared by ``options.tile``: forward
    chunk by chunk, and, when autograd records, the node that recomputes chunk by chunk in
    backward. Of the other options it reads ``preserve_rng_state``, ``determinism_check`` and
    ``debug`` (``check_tile_options`` has refused those with no tiled meaning)."""
    tiling = check_tiling(options.tile, api)
    if _compiled.compiling():  # Rule 9
        return _compiled.torch_region(
            function,
            args,
            kwargs,
            CheckpointOptions(
                use_reentrant=False,
                preserve_rng_state=options.preserve_rng_state,
                determinism_check=options.determinism_check,
            ),
        )
    if isinstance(function, nn.Module):
        refuse_mixing(function, api)
    if params is None:
        params = module_parameters(function)
    run = TiledRun(function, args, kwargs, tiling.dim, tiling.split, tiling.bounds, params, api)
    run.check_values = metadata_fn_for(options.determinism_check) is not None
    run.gated = gated_mlp(function, args, kwargs, tiling.dim, tiling.split)
    run.probe = debug_enabled(options.debug)
    wants_grad = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not torch.is_grad_enabled() or not (wants_grad or params):
        with torch.no_grad():
            return run.rebuild(run.forward(args, capture=None))
    run.preserve = options.preserve_rng_state
    run.grad_args = wants_grad
    run.saved = _compat.save_inputs(args)  # Rule 2: saved before any chunk runs
    inputs = [args[i] for i in wants_grad]
    outs = TiledNode.apply(run, *inputs, *params)  # type: ignore[no-untyped-call]  # untyped
    return run.rebuild(outs)


class TiledForward:
    """A module's ``forward`` while ``checkpoint_module(module, tile=...)`` tiles it: its own
    forward (the class's, or an instance ``forward`` set before) as a tiled region whose
    parameters are the module's. It holds the module weakly (no cycle)."""

    __slots__ = ("__weakref__", "module", "options", "own")

    def __init__(
        self, module: nn.Module, own: Callable[..., Any] | None, options: CheckpointOptions
    ) -> None:
        self.module = weakref.ref(module)
        self.own = own
        self.options = options  # its ``tile`` is the region's ``Tiling``

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module()
        if module is None:
            internal_error("a tiled forward outlived its module")
        forward = self.own or functools.partial(type(module).forward, module)
        params = tuple(p for p in module.parameters() if p.requires_grad)
        return run_tiled(
            forward,
            args,
            kwargs,
            self.options,
            params=params,
            api="checkpointing.checkpoint_module",
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled and deep-copied with the module it belongs to."""
        return (type(self), (self.module(), self.own, self.options))
