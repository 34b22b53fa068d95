"""A Hugging Face model checkpointed with ``checkpointing``: one line instead of HF's own.

A tiny randomly initialised Llama (4 layers, hidden 64, dropout on) trained for a few AdamW steps
five ways from the same weights and seed: no checkpointing, transformers' own
``model.activation_checkpointing_enable()`` (torch's checkpoint), and ours with
``checkpointing.integrations.transformers.enable(model)``, plain, with ``save_matmuls()`` and
with ``budget=0.5`` (a plan that keeps half the activation bytes at the least recompute, printed
below the table). For each we print the activation bytes kept for backward in the first step
(RNG states left out: the report sees ours and not torch's), the CPU time per step (one thread,
the runs taking turns step by step) against transformers' own checkpointing, and the losses;
then check that every run gives the very same losses and final weights.

Run: python examples/08_transformers.py    (needs transformers: pip install transformers==5.23.0)
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import transformers

import checkpointing
from checkpointing.integrations import transformers as hf_checkpointing
from checkpointing.policies import save_matmuls

VOCAB, LAYERS, HIDDEN, BATCH, SEQ, STEPS = 128, 4, 64, 4, 64, 10


def make_model() -> transformers.LlamaForCausalLM:
    """The same freshly initialised model every time (fixed seed), in training mode."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.1,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).train()


@dataclass
class Run:
    """One way of training: its model, optimizer and what it measured."""

    model: transformers.PreTrainedModel
    optimizer: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    kept: int = 0  # activation bytes kept for backward in step 1, RNG states left out
    kept_all: int = 0  # the same with the RNG states our checkpoints keep (what a plan counts)
    seconds: float = 0.0  # CPU time of steps 2 onwards (step 1 runs under the report)

    def step(self, index: int, ids: torch.Tensor) -> None:
        torch.manual_seed(100 + index)  # the same dropout masks in every run
        start = time.process_time()
        if index == 0:
            with checkpointing.saved_tensors_report() as report:
                loss = self.model(input_ids=ids, labels=ids).loss
                loss.backward()
            # The report sees the RNG states our checkpoints keep, not those of torch's own
            # (one per layer too): the table leaves them out to compare like with like.
            self.kept = report.activation_bytes - report.rng_state_bytes
            self.kept_all = report.activation_bytes
        else:
            loss = self.model(input_ids=ids, labels=ids).loss
            loss.backward()
            self.seconds += time.process_time() - start
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.losses.append(loss.item())


PLANS: list[checkpointing.ActivationPlan] = []


def fit_half_the_bytes(model: transformers.PreTrainedModel) -> None:
    """``budget=0.5``, planned on one batch of the training shapes; the plan is kept to print."""
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    PLANS.append(hf_checkpointing.enable(model, budget=0.5, example_kwargs=batch))


def start(setup: Callable[[transformers.PreTrainedModel], None]) -> Run:
    model = make_model()
    setup(model)
    return Run(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


RUNS: dict[str, Callable[[transformers.PreTrainedModel], None]] = {
    "no checkpointing": lambda model: None,
    "HF's own (torch checkpoint)": lambda model: model.activation_checkpointing_enable(),
    "ours: enable(model)": hf_checkpointing.enable,
    "ours: policy=save_matmuls()": lambda m: hf_checkpointing.enable(m, policy=save_matmuls()),
    "ours: budget=0.5": fit_half_the_bytes,
}


def main() -> None:
    torch.set_num_threads(1)  # CPU time then measures work, not threads waiting for each other
    results = {name: start(setup) for name, setup in RUNS.items()}
    batches = torch.Generator().manual_seed(1)
    for index in range(STEPS):  # the runs take turns, so that timings see the same machine
        first = torch.randint(VOCAB, (BATCH, 1), generator=batches)
        ids = (first + torch.arange(SEQ)) % VOCAB  # counting sequences: learnable
        for run in results.values():
            run.step(index, ids)
    reference = results["HF's own (torch checkpoint)"]
    print(f"{'':<30} {'activations kept':>17} {'step time vs HF':>16}   loss: first -> last")
    for name, run in results.items():
        losses = f"{run.losses[0]:.4f} -> {run.losses[-1]:.4f}"
        ratio = run.seconds / reference.seconds
        print(f"{name:<30} {run.kept:>15,} B {ratio:>15.2f}x   {losses}")
    for name, run in results.items():
        assert run.losses == reference.losses, f"{name}: losses differ from HF's own"
        weights = zip(run.model.parameters(), reference.model.parameters(), strict=True)
        assert all(torch.equal(mine, theirs) for mine, theirs in weights), name
    kept = {name: run.kept for name, run in results.items()}
    assert kept["ours: enable(model)"] <= kept["HF's own (torch checkpoint)"]
    assert kept["HF's own (torch checkpoint)"] < kept["no checkpointing"]
    (plan,) = PLANS
    assert results["ours: budget=0.5"].kept_all <= plan.budget_bytes * 1.02
    print("Every run gave the same losses and weights, bit for bit.\n")
    print(plan)


if __name__ == "__main__":
    main()
