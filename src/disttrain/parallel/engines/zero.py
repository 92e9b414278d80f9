"""The engine of ``disttrain_zero1``, ``disttrain_zero2`` (``_offload``) and ``disttrain_zero3`` (``_offload``):
DeepSpeed ZeRO stages 1-3 in torch/deepspeed terms.

DeepSpeed's own engine (``deepspeed.initialize``) partitions the optimizer state (stage 1), the gradients (2) and the
parameters (3), runs backward and steps the optimizer; this engine builds its config from our options (``stage``)
and the Trainer/Fabric settings, runs it on CPU too, swaps in CPU Adam for an offloaded optimizer, keeps BatchNorm
statistics as DDP does, and writes and reads the one checkpoint layout (:mod:`disttrain.parallel.engines.deepspeed`,
:mod:`disttrain.parallel.checkpoint.zero`). What differs between the stages is decided here and in those two
modules.
"""

from __future__ import annotations

import argparse
import os
import weakref
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Iterator, Optional

import torch
from torch import nn

from disttrain.parallel.checkpoint.io import is_zero_checkpoint
from disttrain.parallel.engines.base import Engine, Optimizers, refuse_user_sharding
from disttrain.parallel.engines.buffers import convert_sync_batchnorm, refuse_sync_batchnorm_on_cpu
from disttrain.parallel.engines.layout import (
    Accumulation,
    Buffers,
    Capabilities,
    Dtype,
    Gather,
    Grads,
    Layout,
    Optimizer,
    Params,
    Partition,
    Precision,
    Reduce,
    Steps,
    Units,
    Where,
    Work,
)
from disttrain.parallel.engines.tables import refuse_torchrec_tables
from disttrain.patches import allow_fp16_on_deepspeed_cpu
from disttrain.parallel.engines.deepspeed import (
    REDUCE_BUCKET,
    ZeroOptions,
    attach_zero_optimizer,
    optimizer_later,
    set_extensions_dir,
    to_cpu_adam,
    zero_config,
    zero_grad_norm,
    zero_stage_of,
)
from disttrain.parallel.checkpoint.zero import (
    export_zero,
    load_zero_checkpoint,
    load_zero_state,
    save_zero_tensors,
    zero_model_state,
    zero_optimizer_state,
)


FETCHES_PER_BLOCK = 4  # a block's submodules (attention, MLP, norms) are fetched, with prefetching, in a few calls


def _capabilities(offload: tuple[str, ...]) -> Capabilities:
    return Capabilities(precision=Precision.DEEPSPEED, accumulation=Accumulation.ENGINE, owns_gradients=True,
                        module_transforms=False, compile=False, async_checkpoint=False, offload=offload)


class ZeroEngine(Engine):
    """Holds the options and the DeepSpeed config; sets up, clips, checkpoints and exports ZeRO models (stage 1, 2
    or 3: ``options.stage``)."""

    # (Where modules are built, deepspeed.zero.Init, is the context of Lightning's DeepSpeed strategies, which the
    # adapters keep: it is built from the same config and is what their own set-up expects.)
    options_cls = ZeroOptions
    options: ZeroOptions

    def __init__(self, options: ZeroOptions, name: str = "disttrain_zero3") -> None:
        # One adapter class serves every stage: the name errors quote is the stage's own.
        super().__init__(options, options.name if name.startswith("disttrain_zero") else name)
        set_extensions_dir(options)
        self.config: dict[str, Any] = {}
        # Backward passes since the last optimizer step, per DeepSpeed engine (mark_backward).
        self._backwards: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    @classmethod
    def layout(cls, options: ZeroOptions) -> Layout:
        """What every stage shares: DeepSpeed applies the precision, accumulates inside its engine and owns the
        gradients; its optimizer steps a few flat fp32 partitions (the master copy and the moments, each parameter
        padded to a multiple of the data-parallel ranks), in device memory or where ``offload_optimizer`` says; FP8's
        module swap, compile and async checkpoints are not offered (see ZeroOptions).

        Stage 3: the parameters are partitioned too, in the compute dtype (16-bit under mixed precision), fetched
        submodule by submodule as they are entered, forward and backward (the next ones prefetched), and live where
        ``offload_parameters`` says; gradients are reduce-scattered into their partitions through a reduce bucket
        DeepSpeed allocates whole, and sit with the optimizer that steps them (in host memory for NVMe too: the CPU
        optimizer reads them there).

        Stages 1 and 2: every rank keeps the whole model in the compute dtype; the gradients are reduced bucket by
        bucket during backward into the partition each rank updates, and after each optimizer step the updated
        partitions are all-gathered back into the whole model. Plain modules: no hooks but the gradients' own.
        What is declared is held while gradients accumulate (the Trainer's ``accumulate_grad_batches``, Fabric's
        ``gradient_accumulation_steps``), which is where the stages differ: between micro-steps stage 1 keeps every
        gradient whole (it reduces at the window's last backward only), stage 2 only its partition. Under
        ``offload_optimizer`` the gradient partition is the fp32 master's gradient in host memory, next to a 16-bit
        copy of the partition (the updated weights, cast before the all-gather) and, once a window accumulates, a
        16-bit copy of the partition's gradients that the micro-steps are summed into. Without accumulation stage 1
        keeps only its partition after backward, and offload needs no accumulation copy: less than declared."""
        shard = ("dp_shard", "cp")
        places = {None: Where.DEVICE, "cpu": Where.HOST, "nvme": Where.NVME}
        optimizer_at = places[options.offload_optimizer]
        grads_at = Where.DEVICE if optimizer_at is Where.DEVICE else Where.HOST
        # ZeRO-3's hooks are per submodule (Work.ZERO3, measured); stages 1 and 2 hook every parameter's gradient
        steps = Steps.FLAT if options.stage == 3 else Steps.FLAT_PER_GRADIENT
        optimizer = Optimizer(shard, Dtype.FP32, optimizer_at, master=True, steps=steps)
        if options.stage == 3:
            return Layout(
                params=Params(shard, Dtype.COMPUTE, places[options.offload_parameters], gather=Gather.PER_UNIT,
                              units=Units.SUBMODULES, calls=FETCHES_PER_BLOCK),
                grads=Grads(shard, Dtype.COMPUTE, grads_at, reduce=Reduce.REDUCE_SCATTER, reduce_dtype=Dtype.COMPUTE),
                optimizer=optimizer, partition=Partition.FLAT,
                buffers=Buffers(gathered_units=2, reduce_bucket=REDUCE_BUCKET), work=Work.ZERO3,
                can=_capabilities(offload=("params", "grads", "optimizer")))
        offloaded = optimizer_at is not Where.DEVICE
        if options.stage == 2:
            grads = Grads(shard, Dtype.FP32 if offloaded else Dtype.COMPUTE, grads_at, reduce=Reduce.REDUCE_SCATTER,
                          reduce_dtype=Dtype.COMPUTE, bucket_bytes=2 * REDUCE_BUCKET)
        else:  # whole between micro-steps; reduced into the partition (the master's gradient) at the window's end
            grads = Grads((), Dtype.COMPUTE, Where.DEVICE, reduce=Reduce.REDUCE_SCATTER, reduce_dtype=Dtype.COMPUTE,
                          bucket_bytes=2 * REDUCE_BUCKET)
        return Layout(
            params=Params((), Dtype.COMPUTE, Where.DEVICE, gather=Gather.AFTER_STEP, units=Units.NONE),
            grads=grads, optimizer=optimizer, partition=Partition.FLAT,
            # (stage 1 under offload_optimizer, which no registered name sets, keeps its accumulation copy and
            # fp32 gradient partition in host memory too: not counted here, its gradients are declared whole)
            buffers=Buffers(reduce_bucket=REDUCE_BUCKET, partition_copy=offloaded,
                            accumulation_copy=offloaded and options.stage == 2),
            work=Work.PLAIN, can=_capabilities(offload=("grads", "optimizer")))

    @property
    def builds_partitioned(self) -> bool:
        """Modules are built under ``deepspeed.zero.Init``, each rank keeping its partition (stage 3); below stage 3
        they are built as usual (whole, initialised), and ``empty_init`` does not apply."""
        return self.options.stage == 3

    def device_for(self, device: torch.device, local_rank: int) -> torch.device:
        """DeepSpeed reads the device index as its device rank (None on CPU would crash ``device_rank >= 0``); a CPU
        device with the local rank as index places tensors on the CPU all the same."""
        return torch.device("cpu", local_rank) if device.type == "cpu" else device

    def configure(self, precision: str, micro_batch_size: int, accumulation: int, world_size: int,
                  gradient_clipping: Optional[float], device: torch.device) -> dict[str, Any]:
        """The DeepSpeed config (kept as ``self.config``): batch settings always agree, precision and clipping
        come from the Trainer/Fabric."""
        allow_fp16_on_deepspeed_cpu(device.type, precision)
        self.config = zero_config(self.options, precision=precision, micro_batch_size=micro_batch_size,
                                   accumulation=accumulation, world_size=world_size,
                                   gradient_clipping=gradient_clipping, device_type=device.type)
        return self.config

    # -- the model --------------------------------------------------------------------------------------------
    def prepare(self, module: nn.Module, device: torch.device, training: bool = True, sync_batchnorm: bool = False,
                convert: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
        """Before DeepSpeed sees the module: refuse torchrec tables, SyncBatchNorm when the option or the caller
        asks (refused on CPU for training, as ``ddp`` refuses it). Returns the module to hand to DeepSpeed."""
        refuse_torchrec_tables(module, self.name)
        refuse_user_sharding(module, self.name)
        if self.options.sync_batchnorm or sync_batchnorm:
            module = convert(module) if convert is not None else convert_sync_batchnorm(module)
        if training:
            refuse_sync_batchnorm_on_cpu(module, device, self.name)
        return module

    def optimizer_for(self, optimizer: Any, device: torch.device) -> Any:
        """DeepSpeedCPUAdam in place of Adam/AdamW for an offloaded optimizer when the options ask for it."""
        if optimizer is not None and self.options.use_cpu_adam(device.type):
            return to_cpu_adam(optimizer)
        return optimizer

    def initialize(self, module: nn.Module, optimizer: Any, scheduler: Any, device: torch.device) -> tuple[Any, ...]:
        """``deepspeed.initialize`` with our config: (DeepSpeed engine, its ZeRO optimizer, its scheduler). Without
        an optimizer, the engine gets one later (:meth:`setup_optimizer`)."""
        import deepspeed

        with optimizer_later():
            engine, zero_optimizer, _, zero_scheduler = deepspeed.initialize(
                args=argparse.Namespace(device_rank=device.index), config=self.config, model=module,
                model_parameters=[p for p in module.parameters() if p.requires_grad],
                optimizer=self.optimizer_for(optimizer, device), lr_scheduler=scheduler, dist_init_required=False)
        return engine, zero_optimizer, zero_scheduler

    def setup(self, module: nn.Module, device: torch.device, precision: str, optimizers: Optimizers = (), *,
              container: bool = False, training: bool = True, forward_methods: tuple[str, ...] = (),
              sync_batchnorm: bool = False, convert: Callable[[nn.Module], nn.Module] | None = None,
              scheduler: Any = None) -> tuple[nn.Module, Optimizers]:
        """The DeepSpeed engine over ``module`` (and its ZeRO optimizer over one optimizer made before; DeepSpeed
        trains one optimizer per model), every rank starting from rank 0's buffers. Fabric's set-up (the Trainer
        hands the model over through :meth:`prepare` and :meth:`initialize`)."""
        if len(optimizers) > 1:
            raise ValueError(f"{self.name} takes one optimizer per model (DeepSpeed), got {len(optimizers)}")
        module = self.prepare(module, device, training, sync_batchnorm, convert)
        engine, zero_optimizer, _ = self.initialize(module, optimizers[0] if optimizers else None, scheduler, device)
        self.broadcast_buffers(engine.module)
        return engine, [zero_optimizer] if optimizers else []

    def setup_optimizer(self, engine: Any, optimizer: torch.optim.Optimizer, device: torch.device) -> Any:
        """The ZeRO optimizer over the parameters of an engine set up without one (litgpt's ``setup_module`` then
        ``setup_optimizers``)."""
        own = {id(p) for p in engine.module.parameters()}
        if any(id(p) not in own for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(f"{self.name}: the optimizer holds parameters that are not the last model set up with"
                             " fabric.setup_module; make it from that model's parameters, right after setting it up")
        return attach_zero_optimizer(engine, self.optimizer_for(optimizer, device))

    # -- training ---------------------------------------------------------------------------------------------
    def clip_grad_norm_(self, module: nn.Module, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Returns the whole model's gradient 2-norm and has DeepSpeed clip to ``max_norm`` in the next optimizer
        step (its ZeRO optimizer computes the same norm there and scales the fp32 gradient partitions).
        ``module``: the DeepSpeed engine."""
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type}: {self.name} clips with DeepSpeed, by the 2-norm only; pass"
                             " norm_type=2")
        zero_optimizer = getattr(module, "optimizer", None)
        if zero_optimizer is None or not hasattr(zero_optimizer, "clip_grad"):
            raise RuntimeError(f"{self.name}: clipping needs the optimizer set up with the model"
                               " (fabric.setup(model, optimizer) or fabric.setup_optimizers(optimizer))")
        norm = zero_grad_norm(zero_optimizer)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of order 2.0 for gradients is non-finite ({norm.item()}), so it"
                               " cannot be clipped; pass error_if_nonfinite=False to let DeepSpeed skip the step")
        zero_optimizer.clip_grad = float(max_norm)
        return norm

    def mark_backward(self, engine: Any) -> None:
        """Before each backward of a loop that steps the optimizer once per accumulation window (Fabric's
        ``fabric.backward(loss)`` ... ``optimizer.step()``): tell DeepSpeed whether this backward ends the window,
        i.e. is the ``gradient_accumulation_steps``-th since the last step. ``engine``: the DeepSpeed engine.

        Why: DeepSpeed counts micro-steps in its engine's ``step()``, which such a loop never calls (Fabric's
        ``optimizer.step()`` steps the ZeRO optimizer itself, once per window). Left alone, that count never moves
        and no backward ends a window: stages 1 and 2 would reduce no gradient into the partitions they step (the
        step fails), offloaded stages would never copy their gradients to the host optimizer."""
        steps = engine.gradient_accumulation_steps()
        if steps == 1:
            return  # every backward ends a window (DeepSpeed's own count says so)
        done = self._backwards.get(engine, 0)
        if done == steps:
            raise RuntimeError(f"{self.name}: backward pass {done + 1} since the last optimizer step, but"
                               f" gradient_accumulation_steps={steps}: call optimizer.step() after every {steps}"
                               f" backward passes, or pass ZeroStrategy(gradient_accumulation_steps=N), N the"
                               " backward passes per step")
        engine.set_gradient_accumulation_boundary(done + 1 == steps)
        self._backwards[engine] = done + 1

    def check_window(self, engine: Any) -> None:
        """Before a loop's optimizer step (see :meth:`mark_backward`): the step must end an accumulation window,
        otherwise DeepSpeed would step partitions holding part of the window's gradients (stages 1 and 2: none)."""
        steps = engine.gradient_accumulation_steps()
        done = self._backwards.pop(engine, 0)
        if steps > 1 and done != steps:
            raise RuntimeError(f"{self.name}: optimizer.step() after {done} backward passes, but"
                               f" gradient_accumulation_steps={steps}: call optimizer.step() after every {steps}"
                               f" backward passes, or pass ZeroStrategy(gradient_accumulation_steps=N), N the"
                               " backward passes per step")

    def after_optimizer_step(self, engine: Any) -> None:
        """A ``clip_grad_norm_`` holds for one step; after it, the config's value again."""
        if hasattr(engine.optimizer, "clip_grad"):
            engine.optimizer.clip_grad = engine.gradient_clipping()

    # -- checkpoints: the one layout, each rank writing and reading only its partitions ------------------------
    def is_optimizer(self, value: Any) -> bool:
        return super().is_optimizer(value) or zero_stage_of(value) is not None

    def model_state(self, module: nn.Module) -> dict[str, Any]:
        """ShardedTensors of the partitions (the fp32 master weights when the optimizer holds them); no copy."""
        return zero_model_state(_user_module(module), _master(module))

    def optimizer_state(self, module: nn.Module, optimizer: Any) -> dict[str, Any]:
        return zero_optimizer_state(_user_module(module), optimizer)

    def reads_checkpoint(self, path: str | os.PathLike) -> bool:
        return not is_zero_checkpoint(Path(path))  # DeepSpeed's own folder: read by DeepSpeed

    def save_checkpoint(self, path: str | os.PathLike, module: nn.Module, tensors: dict[str, Any],
                        metadata: dict[str, Any]) -> Path:
        return save_zero_tensors(path, tensors, metadata)

    def load_checkpoint(self, path: str | os.PathLike, module: nn.Module, targets: dict[str, Any],
                        strict: bool = True, weights_only: Optional[bool] = None, source: Any = None) -> dict[str, Any]:
        return load_zero_checkpoint(path, dict(targets), strict=strict, weights_only=weights_only is not False,
                                     master=_master(module), source=source)

    def load_pretrained(self, module: nn.Module, folder: str | os.PathLike, prefix: str = "",
                        partial: bool = False, exclude: Collection[str] = ()) -> list[str]:
        """An HF folder's (or one safetensors file's) weights into the partitions (and the fp32 master weights), each
        rank reading only the rows its partitions cover; ``exclude``: tensor names (as stored) left as they are."""
        from disttrain.parallel.checkpoint.io import _tied_aliases
        from disttrain.parallel.checkpoint.frozen import remember_base
        from disttrain.parallel.checkpoint.pretrained import MODEL_KEY, PretrainedReader, pretrained_names

        user = _user_module(module)
        names, tied = pretrained_names(folder, user.state_dict(), prefix, lambda loaded: _tied_aliases(user, loaded),
                                       partial, exclude)
        targets = {f"{MODEL_KEY}.{k}": s for k, s in names.items()}
        load_zero_state(folder, user, _master(module), MODEL_KEY, None, strict=False,
                         reader=PretrainedReader(folder, targets), stored=set(targets))
        if not partial:
            remember_base(user, folder, names, tied)  # checkpoints name tensors as the unwrapped model
        return tied

    def full_model(self, module: nn.Module) -> AbstractContextManager[nn.Module]:
        """Below stage 3 every rank holds the whole parameters (in the training dtype): ``module`` under
        ``torch.no_grad()``. Stage 3 refuses, naming ``export_full``: it gathers parameters a submodule at a time."""
        if self.builds_partitioned:
            return super().full_model(module)
        return _no_grad(module)

    def export(self, module: nn.Module, path: str | os.PathLike, prefix: str = "") -> Path:
        """The full model in its training dtype (for the fp32 master weights of a checkpoint: ``disttrain export``)."""
        return export_zero(_user_module(module), path, prefix=prefix)


def _user_module(module: nn.Module) -> nn.Module:
    """The user's model inside a DeepSpeed engine (the module itself when it is not one)."""
    from deepspeed import DeepSpeedEngine

    return module.module if isinstance(module, DeepSpeedEngine) else module


@contextmanager
def _no_grad(module: nn.Module) -> Iterator[nn.Module]:
    with torch.no_grad():
        yield module


def _master(module: nn.Module) -> Any:
    """The ZeRO optimizer holding the engine's fp32 master weights (None for an engine without one: inference)."""
    optimizer = getattr(module, "optimizer", None)
    return optimizer if zero_stage_of(optimizer) is not None else None


__all__ = ["ZeroEngine", "ZeroOptions"]
