"""What ``import checkpointing`` costs: the compiler stack stays out until something compiles."""

from __future__ import annotations

import subprocess
import sys

import torch

from checkpointing import _compat

# Imported by ``torch._dynamo`` (about 1 s on top of ``import torch``) and never by plain torch.
_COMPILER_STACK = ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.fsdp")


def _modules_after(code: str) -> set[str]:
    """The names in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    script = code + "\nimport sys\nprint('\\n'.join(sys.modules))\n"
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, check=True
    )
    return set(done.stdout.split())


def test_import_leaves_the_compiler_stack_unimported() -> None:
    """``import checkpointing`` imports none of the compiler stack that ``import torch`` leaves
    out (each would cost most of a second)."""
    plain = _modules_after("import torch")
    ours = _modules_after("import torch, checkpointing")
    assert not [name for name in _COMPILER_STACK if name in plain]
    assert [name for name in _COMPILER_STACK if name in ours] == []


def test_our_constant_result_mark_is_torchs() -> None:
    """``_compat.assume_constant_result`` marks a function exactly as
    ``torch.compiler.assume_constant_result`` does (same attributes set), so dynamo still calls
    our once-only warnings at trace time without a graph break."""

    def theirs() -> bool:
        return True

    def ours() -> bool:
        return True

    before = set(vars(theirs))
    torch.compiler.assume_constant_result(theirs)
    _compat.assume_constant_result(ours)
    added = {name: getattr(theirs, name) for name in set(vars(theirs)) - before}
    assert added  # torch marks something; if not, our mark has nothing to mirror
    assert {name: getattr(ours, name, None) for name in added} == added
