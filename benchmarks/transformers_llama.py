"""A Hugging Face Llama checkpointed by transformers (torch's checkpoint) and by ``checkpointing``.

Usage (from the repository root; needs ``pip install transformers==5.23.0``)::

    python benchmarks/transformers_llama.py            # the row in RESULTS.md, about 3 minutes
    python benchmarks/transformers_llama.py --quick    # smoke run on a tiny model, seconds

The model: a randomly initialised ``LlamaForCausalLM`` (8 layers, hidden 256, 8 heads with 4
key/value heads, MLP 688, vocabulary 1024), batch 2 x 256 tokens, training mode. A *step* is:
gradients set to ``None``, forward with ``labels`` (the causal-LM loss), ``loss.backward()``.

Configurations, all switched on the model with one call:

- ``none``: no checkpointing;
- ``HF + torch, full``: ``model.activation_checkpointing_enable()`` (torch's non-reentrant
  checkpoint per layer);
- ``HF + torch, SAC matmuls``: the same, with torch's selective checkpointing through
  ``activation_checkpointing_kwargs={"context_fn": ...}`` saving the matmul and attention ops;
- ``HF + ours, full``: ``checkpointing.integrations.transformers.enable(model)``;
- ``HF + ours, save_matmuls``: ``enable(model, policy=save_matmuls())``;
- ``HF + ours, offload matmuls``: ``enable(model, policy=offload_ops(*MATMUL_OPS))``: the
  outputs ``save_matmuls`` keeps go to host memory instead. On a CPU-only machine host memory is
  where they are already, so they stay in place (counted as offloaded, not as kept); the time is
  then that of ``save_matmuls``; the device-to-host copies show only on an accelerator.

transformers' own ``offload=True`` is left out: in 5.23 it wraps every checkpoint in
``save_on_cpu(pin_memory=True)``, which raises on a machine without an accelerator.

Method, as in ``benchmarks/run.py``: one torch thread, each configuration warmed up, then timed
rounds in A B B A order, one step per sample, on the process CPU clock; reported: median
(min-max) per step and the ratio of medians to ``HF + torch, full``. Memory, each in its own
step outside the timed rounds: *kept* = activation bytes kept for backward by
``checkpointing.saved_tensors_report()`` (distinct storages, parameters and inputs left out, our
selective cache included; torch's selective cache is invisible to it, so the torch SAC row
undercounts there), *offloaded* = bytes a policy moved to host memory, *held* and *peak* = the
CPU allocator's bytes held at the end of the forward (every activation kept by any means, plus
the logits and loss) and its peak over forward and backward, above the step's start
(``_memory.py``; on a CPU-only machine offloaded tensors stay in these). Before
timing, the script checks that every configuration gives the plain run's loss and gradients.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint as torch_checkpoint
import transformers
from _libs import MATMUL_OPS
from _memory import allocator_bytes

import checkpointing
from checkpointing.integrations import transformers as hf_checkpointing
from checkpointing.policies import offload_ops, save_matmuls

Setup = Callable[[transformers.PreTrainedModel], None]

SETUPS: dict[str, Setup] = {
    "none": lambda model: None,
    "HF + torch, full": lambda model: model.activation_checkpointing_enable(),
    "HF + torch, SAC matmuls": lambda model: model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={
            "use_reentrant": False,
            "context_fn": functools.partial(
                torch_checkpoint.create_selective_checkpoint_contexts, list(MATMUL_OPS)
            ),
        }
    ),
    "HF + ours, full": hf_checkpointing.enable,
    "HF + ours, save_matmuls": lambda m: hf_checkpointing.enable(m, policy=save_matmuls()),
    "HF + ours, offload matmuls": lambda m: hf_checkpointing.enable(
        m, policy=offload_ops(*MATMUL_OPS)
    ),
}
REFERENCE = "HF + torch, full"


@dataclass
class Config:
    """One configuration: its model and what was measured."""

    name: str
    model: transformers.PreTrainedModel
    ids: torch.Tensor
    times: list[float] = field(default_factory=list)
    kept: int = 0
    offloaded: int = 0
    held: int = 0
    peak: int = 0

    def loss(self) -> torch.Tensor:
        torch.manual_seed(0)
        loss: torch.Tensor = self.model(input_ids=self.ids, labels=self.ids).loss
        return loss

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.loss().backward()


def make_model(quick: bool) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=32 if quick else 256,
        intermediate_size=88 if quick else 688,
        num_hidden_layers=2 if quick else 8,
        num_attention_heads=8,
        num_key_value_heads=4,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).train()


def build(quick: bool) -> list[Config]:
    base = make_model(quick)
    ids = torch.randint(1024, (2, 32 if quick else 256), generator=torch.Generator().manual_seed(1))
    configs = []
    for name, setup in SETUPS.items():
        model = copy.deepcopy(base)
        setup(model)
        configs.append(Config(name, model, ids))
    return configs


def check_gradients(configs: list[Config]) -> None:
    """Every configuration gives the plain run's loss and gradients (to float rounding: SAC
    keeps the forward's outputs where recompute would redo them, bit for bit here)."""
    results = []
    for config in configs:
        config.step()
        results.append([p.grad.clone() for p in config.model.parameters() if p.grad is not None])
    for config, grads in zip(configs, results, strict=True):
        same = all(torch.equal(a, b) for a, b in zip(grads, results[0], strict=True))
        if not same or len(grads) != len(results[0]):
            sys.exit(f"{config.name}: gradients differ from the plain run")


def measure_memory(config: Config) -> None:
    config.model.zero_grad(set_to_none=True)
    with checkpointing.saved_tensors_report() as report:
        config.loss().backward()
    config.kept = report.activation_bytes
    config.offloaded = report.bytes_by_decision()["offloaded"]
    config.model.zero_grad(set_to_none=True)
    config.held, config.peak = allocator_bytes(config.loss)


def time_rounds(configs: list[Config], rounds: int, warmup: int) -> None:
    for config in configs:
        for _ in range(warmup):
            config.step()
    for index in range(rounds):
        for config in configs if index % 2 == 0 else configs[::-1]:
            gc.collect()
            start = time.process_time()
            config.step()
            config.times.append(time.process_time() - start)


def table(configs: list[Config]) -> list[str]:
    reference = statistics.median(next(c for c in configs if c.name == REFERENCE).times)
    lines = [
        "| configuration | ms/step, median (min-max) | vs HF + torch, full | kept (report) "
        "| offloaded | held after forward | peak |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in configs:
        median = statistics.median(c.times)
        lines.append(
            f"| {c.name} | {median * 1e3:.0f} ({min(c.times) * 1e3:.0f}-{max(c.times) * 1e3:.0f}) "
            f"| {median / reference:.2f} | {mib(c.kept)} | {mib(c.offloaded)} | {mib(c.held)} "
            f"| {mib(c.peak)} |"
        )
    return lines


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n else "0"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, a smoke run")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per configuration")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    configs = build(args.quick)
    check_gradients(configs)
    for config in configs:
        measure_memory(config)
    time_rounds(configs, 2 if args.quick else args.rounds, args.warmup)
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, one thread, "
        f"{'QUICK (tiny model)' if args.quick else 'Llama 8 x 256, seq 256, batch 2'}"
    )
    print("\n".join(table(configs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
