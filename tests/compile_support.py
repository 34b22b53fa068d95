"""What the ``torch.compile`` tests share: the backends, their warning filters, a fresh dynamo."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

BACKENDS = ["eager", "aot_eager", "inductor"]


def backends_once_beyond(every_stage: str) -> list[Any]:
    """``BACKENDS`` as parameters, all but ``every_stage`` marked ``once``: CI's release stages
    run that one backend, its first stage all three."""
    return [b if b == every_stage else pytest.param(b, marks=pytest.mark.once) for b in BACKENDS]


# ``pytestmark`` of a compile test module.
COMPILE_MARKS = [
    # After a graph break, dynamo reads ``.grad`` of a non-leaf while it wraps the resumed graph's
    # inputs. It means to hide the resulting warning (torch 2.13, ``safe_grad_filter``), but the
    # suite's "error" filter turns it into an exception first.
    pytest.mark.filterwarnings(
        "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
    ),
    # Importing inductor (torch 2.13) reaches a torch.jit.script_method decorator inside torch.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch and leaves no compiled code behind (autouse in the
    modules that import it)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
