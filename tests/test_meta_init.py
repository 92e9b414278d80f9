"""Meta-device models allocated where their strategy keeps them: under CPU offload the parameters on the host (FSDP2
refuses offloaded parameters on the GPU, the root's embeddings and final norm included), the buffers on the device the
forward runs on. The full run on a GPU is tests/test_gpu.py::test_fabric_offload_meta_init_keeps_parameters_on_host."""

from __future__ import annotations

import torch
from torch import nn

from disttrain.parallel.engines.init import materialize, parameters_home


def test_offloaded_parameters_are_allocated_on_the_host():
    cuda = torch.device("cuda", 0)
    assert parameters_home(cuda, cpu_offload=True) == torch.device("cpu")
    assert parameters_home(cuda, cpu_offload=False) == cuda


def test_materialize_under_offload_puts_parameters_on_the_host_and_buffers_on_the_device():
    # The "device" here is the meta device, which any machine has: what matters is that the two kinds part.
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    materialize(model, torch.device("meta"), cpu_offload=True)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {b.device.type for b in model.buffers()} == {"meta"}
    assert model[1].weight.eq(1).all()  # initialised on the host by the module's own reset_parameters


def test_materialize_without_offload_puts_everything_on_the_device():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    materialize(model, torch.device("cpu"))
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}
    assert model[1].running_var.eq(1).all()
