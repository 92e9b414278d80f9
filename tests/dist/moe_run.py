"""Expert parallelism (disttrain_megatron expert_parallel_size) on HF MoE models, against one process in this script.

Usage: moe_run.py OUT SPEC [SPEC ...] -- MODEL [MODEL ...]    (MODEL: mixtral, qwen2-moe, qwen3-moe;
SPEC@MODEL+MODEL runs that spec on those models only)

For each SPEC (Fabric) and model: 5 optimizer steps with the router's auxiliary loss on; each data-parallel rank
trains on its share of the global batch (ranks of one tensor-parallel group on the same share). The one-process
reference takes the mean of the shares' losses (each with its own auxiliary loss, as every data-parallel strategy
computes it). Records the losses, the full state gathered by export_full next to the reference's, the next step of the
checkpoint resumed into a model with other weights, the expert weights
each rank computes with (its local slice of an experts tensor) and stores (its FSDP shard), against the whole. The
last SPEC also trains the first model once through the Trainer (a LightningModule written for one process).
"""

import copy
import os
import sys

import lightning as L
import torch
import torch.distributed as dist

import disttrain  # noqa: F401  (registers the strategy names)

sys.path.insert(0, os.path.dirname(__file__))
from common import strategy_from_spec, tmpdir, write_result  # noqa: E402

split = sys.argv.index("--")
specs, names = sys.argv[2:split], sys.argv[split + 1:]
VOCAB, SEQ, GLOBAL_BATCH, STEPS = 96, 16, 8, 5


def build(name: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
                  num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
    if name == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4))
    if name == "qwen2-moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=32,
                                                        shared_expert_intermediate_size=48))
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=32, head_dim=16))


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))


def reference(name: str, dp: int) -> tuple[list[float], dict]:
    """The losses of STEPS + 1 steps and the state after STEPS."""
    model = build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses, state = [], {}
    for step in range(STEPS + 1):
        if step == STEPS:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        shares = batch(step).chunk(dp)
        loss = sum(model(input_ids=ids, labels=ids).loss for ids in shares) / dp
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, state


def expert_share(model: torch.nn.Module) -> dict:
    """Elements of the experts' tensors: in all, computed with on this rank (unsharded: the expert-parallel slice),
    stored on this rank (the FSDP shard)."""
    from torch.distributed.tensor import DTensor

    whole = computed = stored = 0
    for name, param in model.named_parameters():
        if ".experts." in name:
            whole += param.numel()
            local = param.to_local() if isinstance(param, DTensor) else param
            stored += local.numel()
            ep_dim = [i for i, n in enumerate(param.device_mesh.mesh_dim_names) if n == "ep"]
            computed += param.numel() // param.device_mesh.size(ep_dim[0]) if ep_dim else param.numel()
    return {"whole": whole, "computed": computed, "stored": stored}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-3)).item()


def fabric_run(fabric: L.Fabric, name: str) -> dict:
    dims = fabric.strategy.engine.dims
    share = dims.coordinates(fabric.global_rank)["dp_shard"]
    ref_losses, ref_state = reference(name, dims.dp)

    def setup(model: torch.nn.Module) -> tuple:
        model = fabric.setup_module(model)
        return model, fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))

    def train(model, optimizer, steps: range) -> list[float]:
        losses = []
        for step in steps:
            ids = batch(step).chunk(dims.dp)[share]
            loss = model(input_ids=ids, labels=ids).loss
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / fabric.world_size)
        return losses

    model, optimizer = setup(build(name))
    losses = train(model, optimizer, range(STEPS))
    out = os.path.join(tmpdir(), f"{name}-{fabric.world_size}-{dims.label().replace(' ', '_')}")
    fabric.strategy.export_full(model, f"{out}.safetensors")
    fabric.save(f"{out}-ckpt", {"model": model, "optimizer": optimizer})
    # the checkpoint resumed into a model with other weights: its next step continues the reference run
    fresh, fresh_optimizer = setup(build(name).apply(lambda m: [p.data.add_(0.01) for p in m.parameters(False)]))
    fabric.load(f"{out}-ckpt", {"model": fresh, "optimizer": fresh_optimizer})
    resumed = train(fresh, fresh_optimizer, range(STEPS, STEPS + 1))
    result = {"losses": losses, "ref_losses": ref_losses[:STEPS], "resumed": resumed, "ref_resumed": ref_losses[STEPS:],
              "experts": expert_share(model)}
    if fabric.global_rank == 0:
        from safetensors.torch import load_file

        state = load_file(f"{out}.safetensors")
        result["export_diff"] = max((relative(state[k], ref_state[k]), k) for k in ref_state)
    fabric.barrier()
    return result


def trainer_run(spec: str, name: str) -> dict:
    from torch.utils.data import DataLoader

    class MoEModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build(name)

        def training_step(self, ids, batch_idx):
            loss = self.model(input_ids=ids, labels=ids).loss
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy_from_spec(spec,
                                                                                                            "trainer"),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    dims = trainer.strategy.engine.parallel_dims(trainer.strategy.engine.options, trainer.world_size)
    share = dims.coordinates(trainer.global_rank)["dp_shard"]
    data = [batch(step).chunk(dims.dp)[share] for step in range(STEPS)]
    module = MoEModule()
    trainer.fit(module, DataLoader(data, batch_size=None))
    ref_losses, _ = reference(name, dims.dp)
    return {"loss": trainer.callback_metrics["loss"].item(), "ref_loss": ref_losses[STEPS - 1]}


results = {}
for given in specs:
    spec, _, only = given.partition("@")  # "SPEC@mixtral": that model only
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy_from_spec(spec,
                                                                                                           "fabric"))
    fabric.launch()
    results[spec] = {name: fabric_run(fabric, name) for name in (only.split("+") if only else names)}
results["trainer"] = trainer_run(specs[-1].partition("@")[0], names[0])
write_result(results)
