"""``disttrain_zero3`` / ``disttrain_zero3_offload`` for the Lightning Trainer: Lightning's DeepSpeed strategy,
changed only where it refuses CPU or builds a config whose batch settings can disagree."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies import DeepSpeedStrategy as _LightningDeepSpeed
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from disttrain._lightning import ZeroPlumbing, layer_sync_request, register_names
from disttrain.parallel.checkpoint import check_checkpoint
from disttrain.parallel.options import build_options
from disttrain.parallel.recsys import refuse_torchrec_tables
from disttrain.parallel.zero import (
    ZeroOptions,
    export_zero3,
    is_zero_checkpoint,
    load_zero3_checkpoint,
    save_zero3_state,
    set_extensions_dir,
)


class ZeroStrategy(ZeroPlumbing, _LightningDeepSpeed):
    """DeepSpeed ZeRO stage 3 for ``lightning.Trainer``, on CUDA (nccl) and on CPU (gloo).

    Options as keywords (:class:`disttrain.parallel.zero.ZeroOptions`): ``offload_optimizer``,
    ``offload_parameters`` ("cpu" or "nvme"), ``nvme_path``, ``config`` (a ds_config merged with ours),
    ``cpu_adam``, ``extensions_dir``. Batch size, accumulation, clipping and precision come from the Trainer.
    ``configure_model`` runs under ``deepspeed.zero.Init``: no rank materialises the whole model.
    """

    strategy_name = "disttrain_zero3"
    register_strategies = classmethod(register_names)

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 precision_plugin: Any = None, process_group_backend: Any = None, **options: Any) -> None:
        self.zero_options = build_options(ZeroOptions, self.strategy_name, options)
        set_extensions_dir(self.zero_options)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, stage=3, config={},
                         remote_device=self.zero_options.offload_parameters)

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips Lightning's "DeepSpeed needs CUDA" check

    def setup_distributed(self) -> None:
        self._validate_devices()
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None
        self.model = self._prepare_batchnorm(self.model, trainer.state.fn == TrainerFn.FITTING,
                                             *layer_sync_request(self._layer_sync))
        super().setup(trainer)
        self._broadcast_buffers(self.lightning_module)  # DDP starts every rank from rank 0's buffers too

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        self._broadcast_buffers(self.lightning_module)  # rank 0's BatchNorm statistics, as under ddp
        return output

    def _format_config(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self.config = self._build_zero_config(
            self.precision_plugin.precision,
            micro_batch_size=self._micro_batch_size(),
            accumulation=trainer.accumulate_grad_batches if trainer is not None else 1,
            gradient_clipping=trainer.gradient_clip_val if trainer is not None else None,
        )

    def _micro_batch_size(self) -> int:
        """The training DataLoader's batch size; 1 for pre-batched data (``batch_size=None``), where DeepSpeed uses
        it only for throughput reporting."""
        source = self.lightning_module.trainer.fit_loop._data_source if self.lightning_module is not None else None
        if source is None or not source.is_defined():
            return 1
        sampler = getattr(source.dataloader(), "batch_sampler", None)
        return getattr(sampler, "batch_size", None) or 1

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
        refuse_torchrec_tables(model, self.strategy_name)
        return super()._setup_model_and_optimizer(model, self._maybe_cpu_adam(optimizer), lr_scheduler)

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        # The Trainer already divided the loss by accumulate_grad_batches; DeepSpeed's engine would divide it by
        # gradient_accumulation_steps again (gradients 1/steps too small; Adam hides it, SGD does not).
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Optional[Any] = None) -> None:
        """The one disttrain layout (a DCP folder by parameter name; see :func:`disttrain.parallel.zero.
        zero3_model_state`), each rank writing only its partitions, atomically; every disttrain strategy loads it at
        any world size."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        optimizer = self.deepspeed_engine.optimizer
        training = hasattr(optimizer, "fp32_partitioned_groups_flat")  # not the inference engine's ZeRO offload
        save_zero3_state(self.broadcast(filepath), self.lightning_module, optimizer, rest, "state_dict",
                         "optimizer_0" if training else None)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A disttrain checkpoint folder of any strategy and world size, each rank reading only what its partitions
        need; a DeepSpeed folder (with ``latest``) is still read by DeepSpeed, at the world size it was saved."""
        path = Path(self.broadcast(checkpoint_path))
        if is_zero_checkpoint(path):
            return super().load_checkpoint(check_checkpoint(path, layout="zero"), weights_only)
        state = {"state_dict": self.lightning_module}
        if self.deepspeed_engine.optimizer is not None and self.lightning_module.trainer.state.fn == "fit":
            state["optimizer_0"] = self.deepspeed_engine.optimizer
        return load_zero3_checkpoint(path, state, strict=self.lightning_module.strict_loading,
                                     weights_only=weights_only is not False, master=self.deepspeed_engine.optimizer)

    def export_full(self, path: Any, prefix: str = "") -> Path:
        """The full model (in its training dtype) as one safetensors file (rank 0). For the fp32 master weights
        of a checkpoint use ``disttrain export CKPT OUT.safetensors``."""
        return export_zero3(self.lightning_module, path, prefix=prefix)
