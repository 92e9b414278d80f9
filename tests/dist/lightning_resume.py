"""Checkpoints written by Lightning's own strategies, resumed under disttrain strategies (2 CPU processes, gloo, fp32).
Usage: lightning_resume.py OUT trainer|fabric

trainer: Lightning's ``ddp``, ``FSDPStrategy(state_dict_type="full")`` and
``ModelParallelStrategy(save_distributed_checkpoint=False)`` (one file each), ``FSDPStrategy(state_dict_type="sharded")``
and ``ModelParallelStrategy`` (DCP folders) and its DeepSpeed strategy's save (a DeepSpeed folder) each write a
checkpoint at step 3; Lightning's ``ddp`` continues its own file to step 5 (the reference; its FSDPStrategy its own
full file too), and disttrain strategies resume each checkpoint to step 5. A resume that must be refused records its
error's text, and so does a module that shards itself in configure_model (as ModelParallelStrategy asks) under
disttrain_fsdp. fabric: the same with ``fabric.save`` under Fabric's ``ddp`` (a file) and ``ModelParallelStrategy``
(a folder). Rank 0 writes every run's losses of steps 4 and 5."""

import os
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

import disttrain

sys.path.insert(0, os.path.dirname(__file__))
from common import LlamaModule, fabric_train, loader, rank_batch, strategy_from_spec, tiny_llama, write_result  # noqa: E402

OUT = os.path.dirname(sys.argv[1])
STEPS, SAVED_AT = 5, 3


class Llama(LlamaModule):
    """Step-indexed data by data-parallel rank: the ranks of one tensor-parallel group train on the same samples."""

    def __init__(self) -> None:
        super().__init__(step_indexed=False)

    def training_step(self, batch, batch_idx):
        sampler = self.trainer.strategy.distributed_sampler_kwargs
        return super().training_step((rank_batch(self.global_step, sampler["rank"], sampler["num_replicas"]),),
                                     batch_idx)


class ShardedLlama(Llama):
    """What ModelParallelStrategy asks of a module: shard it in configure_model on the strategy's device mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class SelfShardingLlama(Llama):
    """ShardedLlama without the mesh's names: fully_shard on its default mesh (every rank)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for layer in self.model.model.layers:
            fully_shard(layer)


class LightningFSDPOnCPU(FSDPStrategy):
    """Lightning's own FSDPStrategy, writing its own sharded checkpoint, on CPU: the Trainer refuses the class itself
    on CPU (accelerator_connector.py, ``type(self._strategy_flag) is FSDPStrategy``), and its ``_setup_model`` passes
    ``device_id=root_device.index`` (None on CPU), which FSDP refuses without an accelerator; wrapping here with
    ``device_id=cpu`` leaves Lightning's ``_setup_model`` (which keeps an already wrapped model) and its
    ``save_checkpoint`` unchanged."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                                         **self.kwargs)
        return super()._setup_model(model)


class LightningDeepSpeedSave(disttrain.strategies.ZeroStrategy):
    """DeepSpeed on CPU (Lightning's DeepSpeedStrategy refuses it), saving with Lightning's own DeepSpeed
    ``save_checkpoint``: ``deepspeed_engine.save_checkpoint(path, client_state=..., tag="checkpoint")``."""

    save_checkpoint = DeepSpeedStrategy.save_checkpoint


def trainer(strategy, steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def write(name: str, strategy, module_cls=Llama) -> str:
    path = os.path.join(OUT, name)
    t = trainer(strategy, SAVED_AT)
    t.fit(module_cls(), loader())
    t.save_checkpoint(path)
    return path


def resume(ckpt: str, spec: str):
    """Losses of steps 4 and 5 resumed from ``ckpt``, or the text of the error that refused it."""
    module = Llama()
    return fit_error(module, spec, ckpt) or module.losses


def fit_error(module: L.LightningModule, spec, ckpt: str | None = None) -> str | None:
    """The text of the error ``trainer.fit`` raised (a refusal is part of the result), None when it trained.
    ``spec``: a strategy, or its name with options (tests/dist/common.py)."""
    try:
        strategy = strategy_from_spec(spec, "trainer") if isinstance(spec, str) else spec
        trainer(strategy, STEPS).fit(module, loader(), ckpt_path=ckpt)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def trainer_part() -> dict:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    ddp = write("ddp.ckpt", "ddp")
    fsdp = write("fsdp.ckpt", LightningFSDPOnCPU(state_dict_type="sharded", auto_wrap_policy={LlamaDecoderLayer}))
    mp = write("mp.ckpt", ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), ShardedLlama)
    fsdp_file = write("fsdp-full.ckpt", LightningFSDPOnCPU(state_dict_type="full", auto_wrap_policy={LlamaDecoderLayer}))
    mp_file = write("mp-full.ckpt", ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                          save_distributed_checkpoint=False), ShardedLlama)
    deepspeed = write("deepspeed.ckpt", LightningDeepSpeedSave())
    weights = os.path.join(OUT, "deepspeed-weights.ckpt")
    if torch.distributed.get_rank() == 0:
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(deepspeed, weights)
    torch.distributed.barrier()
    runs = {"ddp": {spec: resume(ddp, spec) for spec in ("ddp", "disttrain_fsdp", "disttrain_zero3",
                                                          "disttrain_megatron:tensor_parallel_size=2")},
            "fsdp": {spec: resume(fsdp, spec) for spec in ("disttrain_fsdp", "disttrain_zero3", "disttrain_ddp")},
            "mp": {spec: resume(mp, spec) for spec in ("disttrain_fsdp", "disttrain_megatron:tensor_parallel_size=2")},
            "deepspeed": {"disttrain_zero3": resume(deepspeed, "disttrain_zero3")},
            "fsdp-full": {"disttrain_fsdp": resume(fsdp_file, "disttrain_fsdp"),
                          "fsdp": resume(fsdp_file, LightningFSDPOnCPU(state_dict_type="full",
                                                                       auto_wrap_policy={LlamaDecoderLayer}))},
            "mp-full": {"disttrain_fsdp": resume(mp_file, "disttrain_fsdp")}}
    # refused, last: a fit that failed leaves nothing the runs above need
    runs["ddp"]["disttrain_megatron:pipeline_parallel_size=2"] = resume(
        ddp, "disttrain_megatron:pipeline_parallel_size=2,microbatches=2")
    runs["deepspeed"]["disttrain_fsdp"] = resume(deepspeed, "disttrain_fsdp")
    runs["deepspeed-weights"] = {"disttrain_fsdp": resume(weights, "disttrain_fsdp")}
    runs["sharded-in-configure-model"] = {"mesh names": fit_error(ShardedLlama(), "disttrain_fsdp"),
                                          "disttrain_fsdp": fit_error(SelfShardingLlama(), "disttrain_fsdp")}
    return runs


def fabric_run(strategy, steps: int, load: str = "", save: str = ""):
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    with fabric.init_module():
        model = tiny_llama()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if load:
        fabric.load(load, state)
    losses = fabric_train(fabric, model, optimizer, steps, start=state["step"])
    if save:
        state["step"] = steps
        fabric.save(save, state)
    return losses


def parallelize(model, mesh):
    """What Fabric's ModelParallelStrategy asks for: a function that shards the model on its device mesh."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


def fabric_part() -> dict:
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel

    ddp, mp = os.path.join(OUT, "fabric-ddp.ckpt"), os.path.join(OUT, "fabric-mp.ckpt")
    fabric_run("ddp", SAVED_AT, save=ddp)
    fabric_run(FabricModelParallel(parallelize, data_parallel_size=2, tensor_parallel_size=1), SAVED_AT, save=mp)
    return {"ddp": {spec: fabric_run(spec, STEPS, load=ddp) for spec in ("ddp", "disttrain_fsdp", "disttrain_zero3")},
            "mp": {"disttrain_fsdp": fabric_run("disttrain_fsdp", STEPS, load=mp)}}


write_result({"runs": trainer_part() if sys.argv[2] == "trainer" else fabric_part()})
