"""Determinism checks and the debug report for recompute.

Owns what is compared between the original forward and its recompute (the metadata of each saved
tensor), the ``CheckpointError`` messages raised when they disagree, the per-context debug switch
``set_checkpoint_debug_enabled``, and the op logger that turns a mismatch into a report of the ops
run in forward and in recompute, with the user's source line for each and the first op where the
two runs diverge. When and where recompute happens belongs to ``_frame``.

NOTE [Determinism checks]
  Rule 1. The number of tensors saved by recompute must equal the forward's, whatever
          ``determinism_check`` says; a different count is a ``CheckpointError`` with both counts.
  Rule 2. With ``determinism_check="default"`` each recomputed tensor's shape, dtype and device
          must equal the saved one's; the error lists every position that differs.
  Rule 3. ``"none"`` skips Rule 2 (and records no metadata at all in forward); any other value is
          a ``ValueError`` that lists the allowed values.
  Rule 4. With debug on, the error carries both op logs and names the first divergent op, and
          keeps torch's guidance paragraph word for word.
  Rule 5. Without debug, a recompute that saves a tensor of other metadata, or more tensors,
          names the first such tensor's source (the user's line, the expression running there
          and the op that made the tensor, when autograd recorded one), read from the stack
          when the mismatch is seen: nothing is captured while the two runs agree. An exception
          raised inside a recompute (an op that refused the recomputed shapes, selective
          checkpointing's "not found in storage") gets a note naming the region, the user's
          line it was raised under and the likely cause; its type and message stay torch's.
          The text holds nothing particular to the process (no rank, no address), so every
          rank that drifts raises the same message. A rank that does not drift sees no error
          of ours: its backward finishes and it waits at its next collective for the ranks that
          raised, until their processes end (the collective then fails) or the group times out.
          Both name the fix for mixture-of-experts layers: keep the routing
          (``policies.save_routing()``). Not caught without debug: a drift that leaves every
          saved shape as it was, since values are never compared (as in torch): the same token
          counts per expert, or a layer whose shapes never depend on the routing (tokens sorted
          by expert and multiplied by grouped matmuls, as transformers' ``grouped_mm`` experts
          do). Comparing values would cost a kernel per saved tensor and, on an accelerator, a
          synchronization; keeping the routing costs tokens x experts and removes the cause.
  Rule 6. With debug on, the values of the integer and boolean tensors saved in forward
          (indices, counts, masks: what routing makes) are compared with the recomputed ones,
          and a difference is a ``CheckpointError`` naming the first such tensor's position and
          source, with the op logs of Rule 4: the way to find a drift that keeps every shape.
          The forward's tensors are held by reference, not copied (a copy would be an op in the
          forward's log), and compared once the recompute has ended (outside the loggers'
          modes); a tensor written in place since it was saved (its version moved) is skipped.
          Floating-point tensors are never compared: a kernel may round differently in
          recompute and still be right.
"""

from __future__ import annotations

import contextlib
import linecache
import sys
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Literal, NoReturn

import torch

from ._compat import TorchDispatchMode
from ._errors import CheckpointError
from ._recompute_context import DeclaredContext

__all__ = [
    "DeterminismCheck",
    "Metadata",
    "OpLogger",
    "check_counts",
    "check_metadata",
    "check_values",
    "debug_enabled",
    "holds_value",
    "metadata_fn_for",
    "note_recompute_error",
    "recompute_site",
    "set_checkpoint_debug_enabled",
]

DeterminismCheck = Literal["default", "none"]
Metadata = tuple[torch.Size, torch.dtype, torch.device]

_debug_override: ContextVar[bool | None] = ContextVar("checkpointing_debug", default=None)

_MSG_DEBUG_TIP = """
Tip: To see a more detailed error message, either pass `debug=True` to
`checkpointing.checkpoint(...)` (or `torch.utils.checkpoint.checkpoint(...)`) or wrap the code
block with `with checkpointing.set_checkpoint_debug_enabled(True):` to enable checkpoint-debug
mode for this thread/context. The report then lists the ops run in forward and in recompute and
points at the first divergence.
"""
_MSG_COUNT_MISMATCH = (
    "torch.utils.checkpoint: A different number of tensors was saved during the original "
    "forward and recomputation.\n"
    "Number of tensors saved during forward: {forward}\n"
    "Number of tensors saved during recomputation: {recompute}.\n"
    "Likely cause: the checkpointed function takes a different path in recompute (global state, "
    "a flag, or data-dependent control flow changed between forward and backward).\n{tip}"
)
_MSG_TOO_MANY = (
    "torch.utils.checkpoint: trying to save more tensors during recomputation than during the "
    "original forward pass (forward saved {forward}).\n{site}"
    "Likely cause: the checkpointed function takes a different path in recompute.\n{hint}{tip}"
)
_MSG_METADATA_MISMATCH = (
    "torch.utils.checkpoint: Recomputed values for the following tensors have different "
    "metadata than during the forward pass.\n{details}.\n{site}"
    "Likely cause: the checkpointed function computes something different in recompute (shapes "
    "or dtypes depending on global state, autocast or RNG changed between forward and "
    "backward).\n{hint}{tip}"
)
_MSG_VALUE_MISMATCH = (
    "checkpointing: Recomputed values of the following integer or boolean tensors differ from "
    "the forward's (debug mode compares them): positions {positions}.\n{site}"
    "Likely cause: the checkpointed function computes other indices, counts or masks in "
    "recompute than in forward, with the same shapes (data-dependent routing, a counter or "
    "noise that moved, a nondeterministic kernel); the gradients would silently be wrong.\n"
    "{hint}"
)
_MSG_DRIFT_SITE = "First differing tensor: position {idx}, saved during recomputation at {site}\n"
_DRIFT_FIX = (
    "If the region routes tokens to experts (mixture of experts), its recompute routed them "
    "differently (scores computed in another order, a counter or noise that moved): keep the "
    "routing so that recompute replays it, with context_fn=as_context_fn(save_routing()) from "
    "checkpointing.policies (combined with a policy: either(policy, save_routing()))."
)
_MSG_DRIFT_HINT = _DRIFT_FIX + "\n"
_MSG_RECOMPUTE_RAISED = (
    "checkpointing: raised while recomputing {region} for backward, at {site}. If the forward "
    "ran this code without error, the recompute computed something different (global state, "
    "RNG, or data-dependent control flow changed between forward and backward). " + _DRIFT_FIX
)
_MSG_BAD_DETERMINISM_CHECK = (
    "checkpointing.checkpoint: determinism_check should be one of ['default', 'none'], but got "
    "{got!r}. Fix: pass determinism_check='default' (compare shape, dtype and device of "
    "recomputed tensors) or 'none' (skip that comparison)."
)
_MSG_DEBUG_REPORT = """\
An error happened while unpacking tensors; dumping logs of latest computation because you passed
`debug=True` to `checkpointing.checkpoint()` (or enabled checkpoint-debug mode).
+------------------------------------------------------------------------------+
| Operations executed during the original forward:                             |
+------------------------------------------------------------------------------+
{forward_ops}
+------------------------------------------------------------------------------+
| Operations executed during recomputation:                                    |
+------------------------------------------------------------------------------+
{recompute_ops}
+------------------------------------------------------------------------------+
{divergence}
 ERROR: Detected non-determinism while running activation checkpointing

{guidance}
 In this report each operator is followed by the line of your code that ran it ("at
 file:line"), detach calls are left out of the comparison (checkpointing itself adds them), and
 the first divergence is named above the ERROR line.
 Original error:
{error}
"""
# torch's own guidance, word for word: tools and tests search error texts for it. Its last part
# (a map of torch's four report sections) is left out: this report is laid out differently.
_MSG_TORCH_GUIDANCE = """\
 You are seeing this error because you passed `debug=True` to checkpoint and
 tensors to be saved during the original forward and differ between those saved
 during recomputation. This can happen if different operators were ran in the
 original forward and in the recomputation.

 To identify where the mismatch may be coming from, you can do the following:

 1) Compare the operators ran during original forward and recomputation to
    see where they differ. These operators are printed above in the order they
    were executed.

 2) Review the stack trace for each operator to locate its invocation source.
    Each operator's stack trace is printed in their execution order.
"""


@contextlib.contextmanager
def set_checkpoint_debug_enabled(enabled: bool | None) -> Iterator[None]:
    """Override ``debug=`` for checkpoints run in this thread/context; ``None`` defers to the
    argument. Unlike torch's process-global switch, other threads never see the value."""
    token = _debug_override.set(enabled)
    try:
        yield
    finally:
        _debug_override.reset(token)


def debug_enabled(argument: bool) -> bool:
    """The effective debug setting: the context override if set, else the argument."""
    override = _debug_override.get()
    return argument if override is None else override


def metadata_of(x: torch.Tensor) -> Metadata:
    """Shape, dtype and device: cheap to read and enough to catch most divergences."""
    return (x.shape, x.dtype, x.device)


def metadata_fn_for(check: str) -> Callable[[torch.Tensor], Metadata] | None:
    """The metadata recorder for a ``determinism_check`` value (None for "none")."""
    if check == "default":
        return metadata_of
    if check == "none":
        return None
    raise ValueError(_MSG_BAD_DETERMINISM_CHECK.format(got=check))


def _describe(meta: Metadata) -> str:
    shape, dtype, device = meta
    return str({"shape": shape, "dtype": dtype, "device": device})


def check_counts(forward: int, recompute: int) -> None:
    """Rule 1: raise when recompute saved a different number of tensors."""
    if forward != recompute:
        raise CheckpointError(
            _MSG_COUNT_MISMATCH.format(forward=forward, recompute=recompute, tip=_MSG_DEBUG_TIP)
        )


def too_many_saved(forward: int, site: str | None = None) -> NoReturn:
    """Rule 1, seen early: recompute is saving past the forward's count; ``site``: where
    (Rule 5, from ``recompute_site``)."""
    where = "" if site is None else _MSG_DRIFT_SITE.format(idx=forward, site=site)
    raise CheckpointError(
        _MSG_TOO_MANY.format(forward=forward, site=where, hint=_hint(site), tip=_MSG_DEBUG_TIP)
    )


def check_metadata(
    pairs: Sequence[tuple[int, Metadata, torch.Tensor]], site: str | None = None
) -> None:
    """Rule 2: ``pairs`` are (position, saved metadata, recomputed tensor); ``site``: where the
    first of them was saved in the recompute (Rule 5, from ``recompute_site``)."""
    details = [
        f"tensor at position {idx}:\nsaved metadata: {_describe(saved)}\n"
        f"recomputed metadata: {_describe(metadata_of(tensor))}\n"
        for idx, saved, tensor in pairs
        if metadata_of(tensor) != saved
    ]
    if details:
        where = "" if site is None else _MSG_DRIFT_SITE.format(idx=pairs[0][0], site=site)
        raise CheckpointError(
            _MSG_METADATA_MISMATCH.format(
                details="".join(details), site=where, hint=_hint(site), tip=_MSG_DEBUG_TIP
            )
        )


def holds_value(tensor: torch.Tensor) -> bool:
    """Rule 6: whether debug mode compares this saved tensor's values (integer or boolean)."""
    return not (tensor.is_floating_point() or tensor.is_complex())


def check_values(
    forward: dict[int, tuple[torch.Tensor, int]],
    recomputed: Sequence[tuple[int, torch.Tensor, str]],
) -> None:
    """Rule 6: ``forward`` maps a position to the tensor saved there and its version then;
    ``recomputed`` lists (position, recomputed tensor, where it was saved). Call it after the
    recompute, outside the loggers' modes."""
    differing = []
    for idx, tensor, site in recomputed:
        kept = forward.get(idx)
        if kept is None or kept[0]._version != kept[1] or kept[0].shape != tensor.shape:
            continue  # written since it was saved, or a shape mismatch (Rule 2 says it)
        if kept[0].dtype == tensor.dtype and not torch.equal(kept[0], tensor):
            differing.append((idx, site))
    if differing:
        idx, site = differing[0]
        raise CheckpointError(
            _MSG_VALUE_MISMATCH.format(
                positions=", ".join(str(i) for i, _ in differing),
                site=_MSG_DRIFT_SITE.format(idx=idx, site=site),
                hint=_MSG_DRIFT_HINT,
            )
        )


def _hint(site: str | None) -> str:
    """The routing hint goes with a re-run's site (a scope's tape replay cannot route anew)."""
    return "" if site is None else _MSG_DRIFT_HINT


def recompute_site(tensor: torch.Tensor | None = None) -> str:
    """Rule 5: where the recompute is now, read from the stack (call it from a pack hook, on
    the error path only): the user's file and line, the expression running there and the
    line's text; with ``tensor``, the op autograd recorded as its maker, if any."""
    frame = _user_frame_object(sys._getframe(1))
    if frame is None:
        return "<unknown source>"
    code = frame.f_code
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    site = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
    expression = _running_expression(frame)
    if expression and expression != line:
        site += f", running `{expression}`"
    if line:
        site += f"\n    {line}"
    maker = getattr(tensor, "grad_fn", None)
    if maker is not None:
        site += f"\n  (the tensor was made by {maker.name()})"
    return site


def note_recompute_error(error: BaseException, region: str) -> None:
    """Rule 5: add to an exception raised inside a recompute where and why (type and message
    unchanged); the user's line is the deepest one in its traceback."""
    frame = None
    tb = error.__traceback__
    while tb is not None:
        if _is_user_code(tb.tb_frame.f_code.co_filename):
            frame = tb.tb_frame
        tb = tb.tb_next
    site = "<unknown source>"
    if frame is not None:
        code = frame.f_code
        line = linecache.getline(code.co_filename, frame.f_lineno).strip()
        site = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}: {line}"
    error.add_note(_MSG_RECOMPUTE_RAISED.format(region=region, site=site))


# ---------------------------------------------------------------------------------------------
# Debug op logs (Rule 4)
# ---------------------------------------------------------------------------------------------

_OUR_PACKAGE = __name__.rsplit(".", 1)[0].replace(".", "/")
_IGNORED_IN_COMPARISON = ("aten.detach.default",)


@dataclass
class _LoggedOp:
    name: str
    signature: str
    where: str


def _is_user_code(filename: str) -> bool:
    """Whether a code object's file is the user's: not torch, this package, the stdlib's
    contextlib or a frozen module."""
    filename = filename.replace("\\", "/")
    return not (
        "/torch/" in filename
        or f"/{_OUR_PACKAGE}/" in filename
        or filename.startswith("<frozen")
        or "/contextlib.py" in filename
    )


def _user_frame_object(frame: FrameType | None) -> FrameType | None:
    """The first stack frame outside torch, this package and the standard library."""
    while frame is not None and not _is_user_code(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def _user_frame(frame: FrameType | None) -> str:
    """The first stack frame outside torch, this package and the standard library, named."""
    found = _user_frame_object(frame)
    if found is None:
        return "<unknown source>"
    return f"{found.f_code.co_filename}:{found.f_lineno} in {found.f_code.co_name}"


def _running_expression(frame: FrameType) -> str:
    """The source of the expression ``frame`` is executing (the span Python 3.11 records per
    instruction, as its tracebacks underline), on one line; empty when unknown."""
    positions = list(frame.f_code.co_positions())
    index = frame.f_lasti // 2
    if not 0 <= index < len(positions):
        return ""
    start, end, col, end_col = positions[index]
    if start is None or end != start or col is None or end_col is None:
        return ""
    return linecache.getline(frame.f_code.co_filename, start)[col:end_col].strip()


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return repr(value) if isinstance(value, (int, float, bool, str, type(None))) else "..."


@dataclass
class OpLogger:
    """Records every aten op of one pass (forward or recompute) with its user source line."""

    ops: list[_LoggedOp] = field(default_factory=list)

    def mode(self) -> TorchDispatchMode:
        """A fresh dispatch mode that appends to this log while active."""
        return _LoggingMode(self)

    def lines(self) -> str:
        """The log as numbered lines."""
        return (
            "\n".join(
                f"  {i + 1:>4}. {op.signature}\n        at {op.where}"
                for i, op in enumerate(self.ops)
            )
            or "  (no ops recorded)"
        )

    def significant(self) -> list[_LoggedOp]:
        """The ops that take part in the comparison (detaches are ours, not the user's)."""
        return [op for op in self.ops if op.name not in _IGNORED_IN_COMPARISON]


class _LoggingMode(TorchDispatchMode, DeclaredContext):  # type: ignore[no-untyped-call]  # untyped base
    # A skipped kept span only shortens the log (NOTE [Kept spans], Rule 6).
    honours_kept_spans = True

    def __init__(self, log: OpLogger) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.log = log

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        signature = f"{name}({', '.join(_short(a) for a in args)}) -> {_short(out)}"
        self.log.ops.append(_LoggedOp(name, signature, _user_frame(sys._getframe(1))))
        return out


def first_divergence(forward: OpLogger, recompute: OpLogger) -> str:
    """A sentence naming the first op where the two passes differ (beyond torch's report)."""
    fwd, rec = forward.significant(), recompute.significant()
    for i, (a, b) in enumerate(zip(fwd, rec, strict=False)):
        # The source line counts too: the same op from another line means another path.
        if (a.signature, a.where) != (b.signature, b.where):
            return (
                f" First divergence at op {i + 1} (detach ignored):\n"
                f"   forward ran   {a.signature}\n     at {a.where}\n"
                f"   recompute ran {b.signature}\n     at {b.where}\n"
            )
    if len(fwd) != len(rec):
        longer, label = (fwd, "forward") if len(fwd) > len(rec) else (rec, "recompute")
        extra = longer[min(len(fwd), len(rec))]
        return (
            f" First divergence at op {min(len(fwd), len(rec)) + 1} (detach ignored): only the "
            f"{label} ran\n   {extra.signature}\n     at {extra.where}\n"
        )
    return " No divergence in the op sequences (the difference is in values or metadata).\n"


def debug_error(error: CheckpointError, forward: OpLogger, recompute: OpLogger) -> NoReturn:
    """Re-raise ``error`` with both op logs and the first divergence (Rule 4)."""
    raise CheckpointError(
        _MSG_DEBUG_REPORT.format(
            forward_ops=forward.lines(),
            recompute_ops=recompute.lines(),
            divergence=first_divergence(forward, recompute),
            guidance=_MSG_TORCH_GUIDANCE,
            error=str(error),
        )
    ) from error
