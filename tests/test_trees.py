"""The ground floor's ``tensors`` and storage keys (``checkpointing/_trees.py``, NOTE [Storage
keys]): views share a key, tensors without memory of their own have none, and a ``DTensor``
(an FSDP2 parameter's kind) has its local shard's key where its own storage refuses a pointer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from dist_support import free_port

from checkpointing._trees import storage_key, storage_nbytes, tensors


def test_tensors_opens_containers_and_keeps_order() -> None:
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    found = list(tensors(((a, [1, b]), {"k": c, "n": None})))
    assert [t is x for t, x in zip(found, (a, b, c), strict=True)] == [True] * 3


def test_views_share_a_key_and_count_their_whole_storage() -> None:
    base = torch.zeros(4, 8)
    view = base[1:, ::2]
    assert storage_key(view) == storage_key(base) == (base.device, base.data_ptr())
    assert storage_nbytes(view) == storage_nbytes(base) == 4 * 8 * 4
    assert storage_key(base.clone()) != storage_key(base)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(2, 3, device="meta"),
        lambda: torch.zeros(2, 3).to_sparse(),
        lambda: torch.zeros(0),
    ],
    ids=["meta", "sparse", "empty"],
)
def test_no_memory_no_key(make: object) -> None:
    tensor = make()  # type: ignore[operator]
    assert storage_key(tensor) is None
    assert storage_nbytes(tensor) == 0


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-process gloo group on 127.0.0.1, ended after the test."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor_has_its_local_shards_key(one_rank: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    shard = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    sharded = torch.nn.Parameter(shard)
    with pytest.raises(RuntimeError, match="invalid python storage"):
        sharded.untyped_storage().data_ptr()  # what the key must not trip on
    local = shard.to_local()
    assert storage_key(sharded) == storage_key(local) is not None
    assert storage_nbytes(sharded) == local.numel() * local.element_size()
