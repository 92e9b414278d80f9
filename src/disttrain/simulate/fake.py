"""One rank of a world of fake ranks in this process: torch's ``fake`` process-group backend (the one torchtitan's
dry run uses) accepts every collective and moves nothing, so the real sharding code runs at any world size."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """The default process group is a fake one of ``world_size`` ranks in which this process is ``rank``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("disttrain.simulate needs a process without a process group (it creates fake ones); run"
                           " it outside a distributed job")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
