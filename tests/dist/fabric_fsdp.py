"""Fabric + a disttrain strategy on 2 CPU processes: losses, memory, save at step 3, resume into a meta-device
model in a fresh Fabric, export. Usage: fabric_fsdp.py OUT [STRATEGY]"""

import os
import sys

import lightning as L
import torch

import disttrain  # noqa: F401  (registers the strategy names)
from disttrain.parallel import rank_state_bytes
from disttrain.parallel import unsharded_param_bytes
from disttrain.parallel.engines.deepspeed import zero_partition_numel
from disttrain.parallel.engines.fsdp import FSDPEngine

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    fabric_train,
    mean_over_ranks,
    rank_batch,
    probe_input,
    strategy_from_spec,
    tiny_llama,
    tmpdir,
    write_result,
)

spec = sys.argv[2] if len(sys.argv) > 2 else "disttrain_fsdp"


def make_fabric() -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy_from_spec(spec, "fabric"))
    if not os.environ.get("LT_CLI_USED"):
        fabric.launch()
    return fabric


fabric = make_fabric()
model = tiny_llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = fabric.setup(model, optimizer)
ckpt = os.path.join(tmpdir(), "fabric-step3")

memory: dict = {}


def after_step(step: int) -> None:
    if step == 0:
        memory.update(rank_state_bytes(model, optimizer))  # grads still held: params + grads + optimizer state
    if step == 2:
        fabric.save(ckpt, {"model": model, "optimizer": optimizer, "step": step + 1})


losses = fabric_train(fabric, model, optimizer, 5, on_step=after_step)

with torch.no_grad():
    logits = model(input_ids=probe_input()).logits
export = os.path.join(tmpdir(), "fabric-export.safetensors")
fabric.strategy.export_full(model, export)

# A fresh Fabric, the model built on the meta device (never materialised whole), restored from step 3.
fabric2 = make_fabric()
with fabric2.init_module(empty_init=True):
    fresh = tiny_llama()
meta_before_setup = all(p.is_meta for p in fresh.parameters())
zero_partition = zero_partition_numel(fresh)  # under disttrain_zero3: (this rank's elements, all elements)
fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
fresh, fresh_opt = fabric2.setup(fresh, fresh_opt)
inner = fresh.module
sharded = isinstance(getattr(fabric2.strategy, "engine", None), FSDPEngine)
meta_init = {} if not sharded else {  # the model's own init ran on the shards: norms at 1, Linear std 0.02, rotary buffers recomputed
    "norm_ones": bool((inner.model.layers[0].input_layernorm.weight.full_tensor() == 1).all()),
    "q_std": inner.model.layers[0].self_attn.q_proj.weight.full_tensor().std().item(),
    # each rank's shard drawn from its own stream, not a copy of the other's
    "shards_distinct": not torch.equal(*inner.model.layers[0].self_attn.q_proj.weight.full_tensor().chunk(2)),
    "inv_freq_ok": bool(torch.allclose(inner.model.rotary_emb.inv_freq, tiny_llama().model.rotary_emb.inv_freq)),
}
state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
rest = fabric2.load(ckpt, state)
resumed = fabric_train(fabric2, fresh, fresh_opt, 5, start=state["step"])

# Gradient accumulation: 2 micro-steps per optimizer step, gradient sync skipped on the first one
# (FSDP2 set_requires_gradient_sync / DDP no_sync). DeepSpeed accumulates inside its engine instead.
accumulated = []
if "zero" not in spec:
    acc_model = tiny_llama()
    acc_opt = torch.optim.AdamW(acc_model.parameters(), lr=1e-2)
    acc_model, acc_opt = fabric2.setup(acc_model, acc_opt)
    for step in range(3):
        micro_losses = []
        for micro in range(2):
            ids = rank_batch(2 * step + micro, fabric2.global_rank, fabric2.world_size)
            loss = acc_model(input_ids=ids, labels=ids).loss
            with fabric2.no_backward_sync(acc_model, enabled=micro == 0):
                fabric2.backward(loss / 2)
            micro_losses.append(mean_over_ranks(loss))
        acc_opt.step()
        acc_opt.zero_grad()
        accumulated.append(sum(micro_losses) / 2)

write_result({
    "accumulated_losses": accumulated,
    "losses": losses, "resumed_losses": resumed, "resumed_from": state["step"], "rest": sorted(rest),
    "memory": memory, "unsharded": unsharded_param_bytes(model), "logits": logits.tolist(), "export": export,
    "meta_before_setup": meta_before_setup, "meta_init": meta_init, "zero_partition": zero_partition, "sampler": fabric.strategy.distributed_sampler_kwargs
    if sharded else None,
    "local_numel": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in fresh.parameters()),
    "numel": sum(p.numel() for p in fresh.parameters()),
})
