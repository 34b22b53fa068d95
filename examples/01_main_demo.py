"""Train a small MLP with and without checkpointing: less memory kept, the very same gradients.

Run: python examples/01_main_demo.py
"""

import warnings

# The README's command installs torch alone, and torch warns "Failed to initialize NumPy" at
# import when NumPy is missing. Nothing here uses NumPy, so that warning is silenced: it would
# open the demo's output with a message that has nothing to do with checkpointing.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

import torch  # noqa: E402 (after the filter: the warning comes from this import)
from torch import nn  # noqa: E402

import checkpointing  # noqa: E402

STEPS, BATCH, WIDTH, LAYERS, PER_BLOCK = 3, 64, 256, 8, 2


def make_blocks() -> list[nn.Sequential]:
    """8 x (Linear + GELU) in blocks of 2 layers; each block is one checkpointed region."""
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(LAYERS)]
    return [nn.Sequential(*layers[i : i + PER_BLOCK]) for i in range(0, LAYERS, PER_BLOCK)]


def forward_and_measure(
    blocks: list[nn.Sequential], x: torch.Tensor, use_checkpoint: bool
) -> tuple[torch.Tensor, int]:
    """Forward through ``blocks``; return the output and the bytes autograd keeps for backward.

    The outer hook sees every tensor that stays alive until backward. A checkpointed region pushes
    its own hook inside it, so what the outer hook sees there is only what is really kept.
    Parameters are left out: they are in memory whether or not we checkpoint.
    """
    params = {p.untyped_storage().data_ptr() for b in blocks for p in b.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for block in blocks:
            if use_checkpoint:
                x = checkpointing.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
    return x, sum(kept.values())


def train(use_checkpoint: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """A few SGD steps from a fixed seed; return the gradients, final parameters and bytes kept."""
    torch.manual_seed(0)
    blocks = make_blocks()
    params = [p for b in blocks for p in b.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    grads: list[torch.Tensor] = []
    for _ in range(STEPS):
        x, target = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
        out, kept = forward_and_measure(blocks, x, use_checkpoint)
        opt.zero_grad()
        nn.functional.mse_loss(out, target).backward()
        grads += [p.grad.clone() for p in params if p.grad is not None]
        opt.step()
    return grads, [p.detach().clone() for p in params], kept


plain_grads, plain_params, plain_kept = train(use_checkpoint=False)
ckpt_grads, ckpt_params, ckpt_kept = train(use_checkpoint=True)

print(f"kept for backward without checkpointing: {plain_kept / 1024:8.0f} KiB")
print(f"kept for backward with checkpointing:    {ckpt_kept / 1024:8.0f} KiB")
print(f"saving: {plain_kept / ckpt_kept:.1f}x less activation memory")
assert len(plain_grads) == len(ckpt_grads), "some gradients are missing"
assert all(map(torch.equal, plain_grads, ckpt_grads)), "gradients differ"
assert all(map(torch.equal, plain_params, ckpt_params)), "final parameters differ"
print(f"gradients and parameters after {STEPS} SGD steps: identical (torch.equal)")
