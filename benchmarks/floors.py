"""The cost floors behind the W3 numbers: what any hook- or mode-based design must pay per op.

On W3's body (200 tiny elementwise ops, 250 tensors saved per step), one thread, CPU time,
interleaved rounds (A B B A ...), medians:

- a do-nothing pair of saved-tensor hooks (forward + backward), per saved tensor;
- a do-nothing Python ``TorchDispatchMode`` around the forward, per op, with and without the
  ``torch._disable_dynamo`` wrapper that torch 2.13 puts around every mode's
  ``__torch_dispatch__`` (a mode opts out by answering ``False`` from ``_should_skip_dynamo``);
- the forward-side caching mode of selective checkpointing, ours and torch's, per op;
- the scope's floor: the do-nothing mode (no wrapper) over the 200 ops, the do-nothing hooks over
  the saved tensors and one no-grad run of the body (what a replay must compute), summed, as a
  multiple of our non-reentrant checkpoint's overhead on the same body; beside it the scope's
  own overhead, as the benchmark's "scope / non-reentrant" ratio;
- the non-reentrant floor: stripped-down non-reentrant checkpoints (``_bare_checkpoint``), each
  adding one thing torch's contract asks for, as fractions of torch's own overhead, beside ours
  with and without the determinism check. The last rung is the least any design with torch's
  semantics pays in Python: everything above it in ours is the frame's own bookkeeping.

Run: ``python benchmarks/floors.py`` (about 70 s). RESULTS.md quotes its output.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))

from _libs import Library, ours_library, torch_library
from _workloads import tiny_ops

from checkpointing import _compat

OPS = 200


class _Passthrough(TorchDispatchMode):
    """Runs every op unchanged: the cost of a Python dispatch mode itself."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _PassthroughUnwrapped(_Passthrough):
    """The same without torch's dynamo-disabling wrapper around ``__torch_dispatch__``."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _Box:
    """What the do-nothing pack hook stores."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


def _median_seconds(cases: dict[str, Callable[[], object]], rounds: int = 30) -> dict[str, float]:
    """Median seconds per call of each case, timed in A B B A rounds of 20 calls."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for index in range(rounds):
        order = list(cases.items()) if index % 2 == 0 else list(cases.items())[::-1]
        for name, case in order:
            gc.collect()
            start = time.process_time()
            for _ in range(20):
                case()
            times[name].append((time.process_time() - start) / 20)
    return {name: statistics.median(values) for name, values in times.items()}


def hook_floor(x: Tensor, w: Tensor) -> float:
    """Print the cost of do-nothing saved-tensor hooks per saved tensor (forward + backward);
    return their cost per step."""
    saved = 0

    def count(tensor: Tensor) -> Tensor:
        nonlocal saved
        saved += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        tiny_ops(x, w, OPS)

    def plain() -> None:
        tiny_ops(x, w, OPS).sum().backward()

    def hooked() -> None:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Box(t.detach()), _unbox):
            y = tiny_ops(x, w, OPS)
        y.sum().backward()

    medians = _median_seconds({"plain": plain, "hooks": hooked})
    extra = (medians["hooks"] - medians["plain"]) / saved
    print(f"step without hooks: {medians['plain'] * 1e3:.3f} ms ({saved} saved tensors)")
    print(f"do-nothing saved-tensor hooks: +{extra * 1e6:.2f} us per saved tensor")
    return extra * saved


def _unbox(box: _Box) -> Tensor:
    return box.tensor


def mode_floor(x: Tensor, w: Tensor, libs: list[Library]) -> float:
    """Print the per-op cost of dispatch modes around the forward (no backward); return the
    cheapest one's (no dynamo wrapper) cost per step."""

    def under(make: Callable[[], Any]) -> Callable[[], object]:
        def run() -> object:
            with make():
                return tiny_ops(x, w, OPS)

        return run

    cases: dict[str, Callable[[], object]] = {
        "no mode": lambda: tiny_ops(x, w, OPS),
        "do-nothing mode": under(_Passthrough),
        "do-nothing mode, no dynamo wrapper": under(_PassthroughUnwrapped),
    }
    for lib in libs:
        make_contexts = lib.save_matmuls
        if make_contexts is not None:
            cases[f"{lib.name} SAC caching mode"] = under(lambda m=make_contexts: m()[0])
    medians = _median_seconds(cases)
    base = medians["no mode"]
    print(f"forward without a mode: {base * 1e3:.3f} ms")
    for name, seconds in medians.items():
        if name != "no mode":
            print(f"{name}: +{(seconds - base) / OPS * 1e6:.2f} us per op")
    return medians["do-nothing mode, no dynamo wrapper"] - base


def scope_floor(x: Tensor, w: Tensor, ours: Library, mode: float, hooks: float) -> None:
    """Print the scope's floor (``mode`` + ``hooks`` + a no-grad run of the body, per step) and
    its overhead, each as a multiple of our non-reentrant checkpoint's overhead."""
    scope = ours.scope
    if scope is None:
        return

    def plain() -> None:
        tiny_ops(x, w, OPS).sum().backward()

    def checkpointed() -> None:
        ours.checkpoint(tiny_ops, x, w, OPS, use_reentrant=False).sum().backward()

    def scoped() -> None:
        with scope():
            y = tiny_ops(x, w, OPS)
        y.sum().backward()

    def replay() -> None:
        with torch.no_grad():
            tiny_ops(x, w, OPS)

    medians = _median_seconds(
        {"plain": plain, "non-reentrant": checkpointed, "scope": scoped, "replay": replay}
    )
    checkpoint_cost = medians["non-reentrant"] - medians["plain"]
    floor = mode + hooks + medians["replay"]
    print(
        f"scope floor (mode {mode * 1e3:.2f} + hooks {hooks * 1e3:.2f} + no-grad body "
        f"{medians['replay'] * 1e3:.2f} ms): {floor / checkpoint_cost:.2f}x our non-reentrant "
        f"overhead ({checkpoint_cost * 1e3:.2f} ms); the scope's overhead: "
        f"{(medians['scope'] - medians['plain']) / checkpoint_cost:.2f}x"
    )


class _Slot(dict[object, Tensor | None]):
    """A bare holder: recomputed tensors by backward key, weakly referenced by the frame."""

    __slots__ = ("__weakref__",)


def _bare_checkpoint(
    fn: Callable[[Tensor], Tensor], x: Tensor, *, holders: bool, metadata: bool, keyed: bool
) -> Tensor:
    """The least a non-reentrant checkpoint of ``fn(x)`` can do, with optional parts of torch's
    contract: ``holders`` (a weakly held object per saved tensor, so a recomputed tensor lives
    no longer than its graph node), ``metadata`` (shape, dtype and device compared after
    recompute) and ``keyed`` (recomputed tensors kept per backward). No early stop, nesting,
    RNG state or errors beyond the metadata check: a measuring stick, not a checkpoint."""
    refs: list[weakref.ref[_Slot]] = []
    values: list[Tensor | None] = []
    recorded: list[tuple[torch.Size, torch.dtype, torch.device]] = []
    recomputed = False

    def pack(tensor: Tensor) -> object:
        if metadata:
            recorded.append((tensor.shape, tensor.dtype, tensor.device))
        if holders:
            slot = _Slot()
            refs.append(weakref.ref(slot))
            return slot
        values.append(None)
        return len(values) - 1

    def recompute(key: object) -> None:
        nonlocal recomputed
        position = 0

        def fill(tensor: Tensor) -> Tensor:
            nonlocal position
            if tensor.requires_grad:
                tensor = tensor.detach()
            if holders:
                slot = refs[position]()
                if slot is not None:
                    slot[key] = tensor
            else:
                values[position] = tensor
            if metadata:
                shape, dtype, device = recorded[position]
                if dtype is not tensor.dtype or shape != tensor.shape or device != tensor.device:
                    raise RuntimeError("recomputed metadata differs")
            position += 1
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(fill, lambda t: t), torch.enable_grad():
            fn(x)
        recomputed = True

    def unpack(packed: Any) -> Tensor:
        key: object = 0
        if keyed:
            key = _compat.get_graph_exec_group()
            if key is None:
                key = _compat.current_graph_task_id()
        if holders:
            if key not in packed:
                recompute(key)
            tensor = packed[key]
            packed[key] = None
        else:
            if not recomputed:
                recompute(key)
            tensor = values[packed]
            values[packed] = None
        if tensor is None:
            raise RuntimeError("unpacked twice")
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(x)


def frame_floor(x: Tensor, w: Tensor, ours: Library, theirs: Library) -> None:
    """Print the non-reentrant ladder on W3's body: each rung's overhead above the plain step,
    as a fraction of torch's non-reentrant overhead (the benchmark's ratio)."""

    def body(h: Tensor) -> Tensor:
        return tiny_ops(h, w, OPS)

    def step(forward: Callable[[], Tensor]) -> Callable[[], None]:
        def run() -> None:
            x.grad = w.grad = None
            forward().sum().backward()

        return run

    def bare(holders: bool, metadata: bool, keyed: bool) -> Callable[[], None]:
        return step(
            lambda: _bare_checkpoint(body, x, holders=holders, metadata=metadata, keyed=keyed)
        )

    cases = {
        "plain": step(lambda: body(x)),
        "torch": step(lambda: theirs.checkpoint(body, x, use_reentrant=False)),
        "ours": step(lambda: ours.checkpoint(body, x, use_reentrant=False)),
        'ours, determinism_check="none"': step(
            lambda: ours.checkpoint(body, x, use_reentrant=False, determinism_check="none")
        ),
        "bare: recompute, hand out, release": bare(False, False, False),
        "bare + holders": bare(True, False, False),
        "bare + holders + metadata check": bare(True, True, False),
        "bare + holders + metadata check + per-backward keys": bare(True, True, True),
    }
    medians = _median_seconds(cases, rounds=40)
    plain = medians.pop("plain")
    torch_cost = medians.pop("torch") - plain
    print(f"non-reentrant on W3, overhead / torch's ({torch_cost * 1e3:.2f} ms):")
    for name, seconds in medians.items():
        print(f"  {name}: {(seconds - plain) / torch_cost:.3f}")


def main() -> int:
    """Measure and print the floors."""
    torch.set_num_threads(1)
    torch.manual_seed(3)
    x = torch.randn(64, requires_grad=True)
    w = torch.nn.Parameter(torch.rand(64) + 0.5)
    ours = ours_library()
    libs = [lib for lib in (ours, torch_library()) if lib is not None]
    hooks = hook_floor(x, w)
    mode = mode_floor(x, w, libs)
    if ours is not None:
        scope_floor(x, w, ours, mode, hooks)
        frame_floor(x, w, ours, torch_library())
    return 0


if __name__ == "__main__":
    sys.exit(main())
