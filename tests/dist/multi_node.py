"""A tiny Llama trained through Fabric on several nodes: one torchrun per node (``--nnodes N --node-rank i``), on
127.0.0.1 or on the hosts of tools/hosts.py (network namespaces). Usage: multi_node.py OUT SPEC STEPS

SPEC: a strategy spec (``disttrain_fsdp:hybrid_shard=true``, ``disttrain_megatron:tensor_parallel_size=2``,
``disttrain_zero3``). Each
data-parallel replica reads its share of the global batch (the ranks of one tensor-parallel group the same
samples); writes the losses (the global batch's mean), the mesh, this rank's parameter elements, its node and
hostname."""

import os
import socket
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import data_parallel_step, strategy_from_spec, tiny_llama, write_result  # noqa: E402

spec, steps = sys.argv[2], int(sys.argv[3])
local = int(os.environ["LOCAL_WORLD_SIZE"])
fabric = L.Fabric(accelerator="cpu", devices=local, num_nodes=int(os.environ["WORLD_SIZE"]) // local,
                  strategy=strategy_from_spec(spec, "fabric"))
fabric.launch()
model = tiny_llama()
total = sum(p.numel() for p in model.parameters())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = fabric.setup(model, optimizer)
engine = fabric.strategy.engine
dp_mesh = engine.meshes.dp if engine.meshes is not None else None  # None: DeepSpeed's engine, every rank dp
losses = [data_parallel_step(fabric, model, optimizer, step, dp_mesh) for step in range(steps)]
mesh = engine.mesh


def held(p: torch.Tensor) -> int:
    """Elements of ``p`` this rank holds: its DTensor shard, or DeepSpeed ZeRO-3's partition."""
    return p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.to_local().numel()


write_result({"losses": losses, "mesh": list(mesh.mesh_dim_names) if mesh else None,
              "shape": list(mesh.shape) if mesh else None,
              "local": sum(held(p) for p in model.parameters()), "total": total,
              "node": int(os.environ["GROUP_RANK"]), "hostname": socket.gethostname()})
# Leave together: a node whose processes exit while the other's still use the gloo pairs aborts at exit.
torch.distributed.barrier()
torch.distributed.destroy_process_group()
