"""Hybrid sharding (HSDP) on a simulated two-node job: started twice with torchrun --nnodes 2 --node-rank {0,1}
--nproc_per_node 2 on 127.0.0.1. Usage: hybrid_fsdp.py OUT STEPS"""

import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import fabric_train, strategy_from_spec, tiny_llama, write_result  # noqa: E402

steps = int(sys.argv[2])
fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=2,
                  strategy=strategy_from_spec("disttrain_fsdp:hybrid_shard=true", "fabric"))
fabric.launch()
model = tiny_llama()
total = sum(p.numel() for p in model.parameters())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = fabric.setup(model, optimizer)
mesh = fabric.strategy.engine.mesh
local = sum(p.to_local().numel() for p in model.parameters())
losses = fabric_train(fabric, model, optimizer, steps)
write_result({"losses": losses, "mesh": list(mesh.mesh_dim_names), "shape": list(mesh.shape), "local": local,
              "total": total, "node": int(os.environ["GROUP_RANK"])})
# Leave together: a node whose processes exit while the other's still use the gloo pairs aborts at exit.
torch.distributed.barrier()
torch.distributed.destroy_process_group()
