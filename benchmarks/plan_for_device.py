"""Planning for a device this machine lacks: a Llama-3-8B-shaped model, by shapes, on the CPU.

Usage (from the repository root; a memory measurement, CPU heavy, no lock needed)::

    python benchmarks/plan_for_device.py
    python benchmarks/plan_for_device.py --layers 2 --hidden 256 --tokens 512   # quick

Model: Hugging Face ``LlamaForCausalLM`` from a ``LlamaConfig`` shaped as Llama 3 8B (32
layers, 4096 wide, 32 query heads, 8 key/value heads, intermediate 14336, vocabulary 128256),
built under ``torch.device("meta")`` in bfloat16, training mode, ``use_cache=True`` (with fake
tensors transformers then skips the causal mask as it does on real ones: the SDPA path of the
real step, grouped keys and values and no mask; NOTE [Planning without memory], Rule 5); the input
batch 1 x 8192 token ids on the meta device; the loss the logits' mean in float32. Planned with
``plan_checkpointing(..., budget=<bytes>, device=--device)`` at each budget of ``--budgets``
(GiB). Nothing of the model is allocated (NOTE [Planning without memory]).

Prints, per budget: the wall and CPU seconds of the call, the process's resident high-water
mark (``ru_maxrss``) after it, and the plan; then the device's named constants.
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))

import checkpointing  # the repository's, after the path above

GIB = 2**30


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--device", default="h100-80gb")
    parser.add_argument("--budgets", type=float, nargs="+", default=[60.0, 40.0, 20.0])
    return parser.parse_args()


def _resident_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    arguments = _arguments()
    import transformers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = transformers.LlamaConfig(
        vocab_size=arguments.vocab,
        hidden_size=arguments.hidden,
        intermediate_size=arguments.intermediate,
        num_hidden_layers=arguments.layers,
        num_attention_heads=arguments.heads,
        num_key_value_heads=arguments.kv_heads,
        max_position_embeddings=max(8192, arguments.tokens),
        use_cache=True,  # Rule 5 of NOTE [Planning without memory]: the real step's mask path
    )
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"resident before building: {_resident_peak() / GIB:.2f} GiB")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"model: {weights / GIB:.2f} GiB of bfloat16 weights, on the meta device")
    tokens = torch.empty(1, arguments.tokens, dtype=torch.long, device="meta")

    def loss_fn(output: Any) -> torch.Tensor:
        loss: torch.Tensor = output.logits.float().mean()
        return loss

    for budget in arguments.budgets:
        started, cpu = time.perf_counter(), time.process_time()
        plan = checkpointing.plan_checkpointing(
            model, tokens, budget=int(budget * GIB), loss_fn=loss_fn, device=arguments.device
        )
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        print(f"\n=== budget {budget:g} GiB: planned in {wall:.1f} s wall, {cpu:.1f} s CPU;")
        print(f"resident high-water mark so far {_resident_peak() / GIB:.2f} GiB")
        print(plan)
    print(f"\nconstants: {plan.costs}")


if __name__ == "__main__":
    main()
