"""ZeRO-1/2 specifics on 2 CPU processes, each stage on the Trainer and on Fabric: losses, what each rank holds of
DeepSpeed's partitions (the Trainer accumulating over 2 micro-batches), Fabric's setup_module + setup_optimizers
with clipping, full_model, Fabric accumulating over 2 micro-batches (every stage; the bytes each rank holds, for the
planner's estimate) and its error on a wrong count of backward passes, bf16, and fp16 with dynamic loss scaling (an
overflow step skipped). Usage: zero12_checks.py OUT

What a rank holds is read from DeepSpeed's stage 1/2 optimizer itself: its fp32 master partitions
(``single_partition_of_fp32_groups``), the optimizer state keyed by them, and the gradients it keeps between
accumulation micro-steps (``param.grad``, whole; ``all_grad_tensors`` / ``averaged_gradients``, the gradients of
the parameters its partition covers; under offload, the fp32 partitions' ``.grad`` and the per-parameter
accumulation buffers in host memory); in bytes, by disttrain.planner.measure.zero12_state_bytes.
"""

import math
import os
import sys

import lightning as L
import torch

import disttrain
from disttrain.callbacks import GradientAccumulation
from disttrain.planner.measure import zero12_state_bytes

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    MICRO_BATCH,
    LlamaModule,
    fabric_train,
    loader,
    mean_over_ranks,
    probe_input,
    rank_batch,
    tiny_llama,
    write_result,
)

NAMES = ("disttrain_zero1", "disttrain_zero2", "disttrain_zero2_offload")
ACCUMULATING = (*NAMES, "disttrain_zero3", "disttrain_zero3_offload")
MICRO_STEPS = 2  # Fabric's accumulation window
MAX_NORM = 0.5  # below the tiny Llama's gradient norms (about 2): every step is clipped


def held(zero) -> dict:
    """Elements of DeepSpeed's state on this rank: fp32 master weights, optimizer state, gradients on the compute
    device and (offload) in host memory."""
    tensors = lambda groups: sum(t.numel() for group in groups if group for t in group)  # noqa: E731
    grads = sum(p.grad.numel() for group in zero.bit16_groups for p in group if p.grad is not None)
    grads += tensors(zero.all_grad_tensors.values()) + tensors(zero.averaged_gradients.values())
    return {
        "grads": grads,
        "host_grads": sum(t.grad.numel() for t in zero.single_partition_of_fp32_groups if t.grad is not None),
        "host_accumulated": sum(t.numel() for t in getattr(zero, "accumulated_grads_in_cpu", {}).values()),
        "master": sum(t.numel() for t in zero.single_partition_of_fp32_groups),
        "optimizer": sum(v.numel() for state in zero.optimizer.state.values() for v in state.values()
                         if torch.is_tensor(v) and v.dim() > 0),
        "master_device": str(zero.single_partition_of_fp32_groups[0].device),
        "stage": 2 if zero.partition_gradients else 1,
    }


def trainer(strategy, precision="32-true", max_steps=5, **kw):
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, max_steps=max_steps,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     **kw)


class BetweenMicroSteps(L.Callback):
    """What DeepSpeed holds after the first micro-batch's backward of an accumulation window."""

    held: dict | None = None

    def on_after_backward(self, trainer, module):
        engine = trainer.strategy.deepspeed_engine
        if self.held is None:
            self.held = {**held(engine.optimizer), "boundary": engine.is_gradient_accumulation_boundary(),
                         "accumulation": engine.gradient_accumulation_steps()}


def trainer_run(name: str) -> dict:
    """5 steps (losses against one process), then 2 more accumulating over 2 micro-batches."""
    module = LlamaModule()
    t = trainer(name)
    t.fit(module, loader())
    between = BetweenMicroSteps()
    trainer(name, max_steps=2, accumulate_grad_batches=2, callbacks=[between]).fit(LlamaModule(), loader())
    return {"losses": module.losses, "held": held(t.strategy.deepspeed_engine.optimizer), "between": between.held,
            "config": t.strategy.config["zero_optimization"], "params": sum(p.numel() for p in module.parameters()),
            "largest": max(p.numel() for p in module.parameters()), "engine": t.strategy.engine.name}


def fabric_run(name: str, steps: int = 3) -> dict:
    """litgpt's set-up (setup_module, then the optimizer from its parameters), every step clipped at MAX_NORM;
    then the full model."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=name)
    fabric.launch()
    model = fabric.setup_module(tiny_llama())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses, norms = [], []
    for step in range(steps):
        ids = rank_batch(step, fabric.global_rank, fabric.world_size)
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss, model=model)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
    with fabric.strategy.full_model(model) as full:
        logits = full(input_ids=probe_input()).logits
        grad_inside = torch.is_grad_enabled()
    with torch.no_grad():
        engine_logits = model(input_ids=probe_input()).logits
    return {"losses": losses, "norms": norms, "held": held(optimizer.optimizer), "logits": logits.tolist(),
            "same_as_engine": bool(torch.equal(logits, engine_logits)), "grad_inside_full_model": grad_inside,
            "engine": fabric.strategy.engine.name}


def fabric_accumulation_run(name: str, steps: int = 3) -> dict:
    """Fabric's accumulation as a user writes it (GradientAccumulation.attach sets the strategy's
    gradient_accumulation_steps): MICRO_STEPS backward passes, then optimizer.step(). Losses per optimizer step (the
    mean of its micro-steps'), and below stage 3 the largest bytes of each kind a rank held after a backward or a
    step (zero12_state_bytes)."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=name)
    accumulation = GradientAccumulation(global_batch_size=MICRO_STEPS * MICRO_BATCH * 2)
    micro_steps = accumulation.attach(fabric, micro_batch_size=MICRO_BATCH)
    fabric.launch()
    model = tiny_llama()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    zero = optimizer.optimizer
    peak: dict[str, int] = {}

    def measure() -> None:
        if hasattr(zero, "single_partition_of_fp32_groups"):  # stages 1 and 2
            for key, value in zero12_state_bytes(zero).items():
                peak[key] = max(peak.get(key, 0), value)

    losses = []
    for step in range(steps):
        micro = []
        for i in range(micro_steps):
            ids = rank_batch(step * micro_steps + i, fabric.global_rank, fabric.world_size)
            with accumulation.micro_step(fabric, model, i):
                loss = model(input_ids=ids, labels=ids).loss
                fabric.backward(accumulation.scale(fabric, loss))
            measure()
            micro.append(mean_over_ranks(loss))
        optimizer.step()
        measure()
        optimizer.zero_grad()
        losses.append(sum(micro) / len(micro))
    return {"losses": losses, "micro_steps": micro_steps, "bytes": peak,
            "accumulation": fabric.strategy.config["gradient_accumulation_steps"],
            "params": sum(p.numel() for p in model.parameters())}


def fabric_wrong_counts(name: str = "disttrain_zero2") -> dict:
    """gradient_accumulation_steps=2, then a step after one backward, and a third backward in a window."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=disttrain.fabric.ZeroStrategy(
        **_defaults(name), gradient_accumulation_steps=MICRO_STEPS))
    fabric.launch()
    model = tiny_llama()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = rank_batch(0, fabric.global_rank, fabric.world_size)
    backward = lambda: fabric.backward(model(input_ids=ids, labels=ids).loss)  # noqa: E731
    errors = {}
    backward()
    try:
        optimizer.step()
    except RuntimeError as e:
        errors["early_step"] = str(e)
    optimizer.zero_grad()
    for _ in range(MICRO_STEPS):
        backward()
    optimizer.step()  # a whole window steps again after the refused step
    optimizer.zero_grad()
    for _ in range(MICRO_STEPS):
        backward()
    try:
        backward()
    except RuntimeError as e:
        errors["extra_backward"] = str(e)
    return errors


def _defaults(name: str) -> dict:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    return dict(STRATEGY_REGISTRY[name]["init_params"])


class Overflow(LlamaModule):
    """Step 2's loss is multiplied by inf: its fp16 gradients overflow and DeepSpeed must skip that step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        zero = self.trainer.strategy.deepspeed_engine.optimizer
        if self.global_step == 1:
            self.scale_before = zero.loss_scale
            self.master_before = [t.detach().clone() for t in zero.single_partition_of_fp32_groups]
            return loss * math.inf
        if self.global_step == 2:
            self.master_after = [t.detach().clone() for t in zero.single_partition_of_fp32_groups]
            self.scale_after = zero.loss_scale
        return loss


def fp16_run() -> dict:
    overflow = Overflow()
    t = trainer("disttrain_zero2", precision="16-mixed")
    t.fit(overflow, loader())
    engine = t.strategy.deepspeed_engine
    return {"losses": overflow.losses, "skipped_steps": engine.skipped_steps, "global_step": t.global_step,
            "scale_before": overflow.scale_before, "scale_after": overflow.scale_after,
            "unchanged_by_overflow": all(torch.equal(a, b) for a, b in zip(overflow.master_before,
                                                                              overflow.master_after)),
            "fp16_enabled": t.strategy.config["fp16"]["enabled"],
            "param_dtype": str(next(engine.module.parameters()).dtype)}


def bf16_run() -> dict:
    """bf16 compute with fp32 master partitions; the checkpoint holds the fp32 master weights."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="disttrain_zero2", precision="bf16-mixed")
    fabric.launch()
    model = tiny_llama()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = fabric_train(fabric, model, optimizer, 3)
    path = os.path.join(os.path.dirname(sys.argv[1]), "bf16-ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer})
    from disttrain.parallel.checkpoint.io import stored_entries

    dtypes = sorted({str(md.properties.dtype) for key, md in stored_entries(path).items()
                     if key.startswith("model.") and hasattr(md, "chunks")})
    return {"losses": losses, "param_dtype": str(next(model.parameters()).dtype),
            "master_dtype": str(optimizer.optimizer.single_partition_of_fp32_groups[0].dtype),
            "stored_model_dtypes": dtypes}


result = {"trainer": {name: trainer_run(name) for name in NAMES},
          "fabric": {name: fabric_run(name) for name in NAMES},
          "fabric_accumulation": {name: fabric_accumulation_run(name) for name in ACCUMULATING},
          "fabric_wrong_counts": fabric_wrong_counts(),
          "fp16": fp16_run(), "bf16": bf16_run()}
write_result(result)
