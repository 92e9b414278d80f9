"""Lightning-side plumbing shared by the Trainer and Fabric adapters (both subclass a ``ParallelStrategy`` with
the same attribute names): process-group start and clean exit, ranks, barrier, broadcast, registration."""

from __future__ import annotations

import atexit
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from disttrain.names import names_for

DEFAULT_TIMEOUT: timedelta = default_pg_timeout
_EXIT_GRACE_S = 0.1  # a worker needs microseconds once scheduled; 0.1 s covers a loaded 2-core machine


def _gloo_workers_alive() -> bool:
    """Whether this process has gloo worker threads (True where that cannot be told: no Linux /proc)."""
    try:
        return any((Path("/proc/self/task") / tid / "comm").read_text().startswith("pt_gloo")
                   for tid in os.listdir("/proc/self/task"))
    except OSError:
        return True


def destroy_process_groups_on_clean_exit() -> None:
    """At exit: destroy the process groups (clean exits only) and let gloo's workers finish before Python finalizes.

    A gloo worker drops its references to a finished collective's tensors after ``wait()`` has returned, and that
    needs the GIL. If the main thread is already finalizing the interpreter, Python ends the worker inside a
    noexcept destructor: "terminate called without an active exception", SIGABRT, exit code -6 after a run that
    succeeded (torch PR 179291). Measured here, 2 processes exiting right after an all_reduce: 6 aborts in 20 runs
    with nothing, 1 in 20 with only ``destroy_process_group`` (Lightning never calls it, and our objects keep the
    groups and their workers alive anyway), 0 in 20 with the pause below, which releases the GIL before
    finalization starts. After an uncaught exception (``sys.last_value``) the groups are left alone: other ranks
    may be inside a collective and destroying could wait for them (torchtitan PR 1342)."""
    if dist.is_available() and dist.is_initialized() and getattr(sys, "last_value", None) is None:
        dist.destroy_process_group()
    if _gloo_workers_alive():
        time.sleep(_EXIT_GRACE_S)


atexit.register(destroy_process_groups_on_clean_exit)  # every adapter imports this module


def register_names(cls: type, registry: Any) -> None:
    """Register ``cls`` under its rows of the name table (idempotent: importing twice is harmless)."""
    for name, defaults, description in names_for(cls.__name__):
        if name not in registry:
            registry.register(name, cls, description=description, **defaults)


class DistributedPlumbing:
    """Mixin for the engine-backed adapters (FSDP now; TP/PP next): process group, ranks, launcher, sampler,
    collectives, written once for the Trainer and Fabric. DDP and ZeRO subclass Lightning's own strategies."""

    parallel_devices: Optional[list[torch.device]]
    _process_group_backend: Optional[str]
    _timeout: Optional[timedelta]
    _launcher_cls: type  # the Trainer's or Fabric's _SubprocessScriptLauncher
    _num_nodes: int = 1  # Fabric's connector sets _num_nodes, the Trainer's num_nodes

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]  (the Lightning strategy after this mixin)
        self._setup_processes_and_mesh()

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None, "the strategy has no devices yet"
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    _set_world_ranks = set_world_ranks  # Fabric's name

    def _init_process_group(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or \
            _get_default_process_group_backend_for_device(self.root_device)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                              device_id=device_id)

    def _init_common(self, engine: Any, process_group_backend: Optional[str], timeout: Optional[timedelta]) -> None:
        """The state every engine-backed adapter keeps (called from both adapters' ``__init__``)."""
        self.engine = engine
        self._process_group_backend = process_group_backend
        self._timeout = timeout

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.engine.sampler_kwargs()

    def _configure_launcher(self) -> None:
        """Start the other local processes ourselves unless torchrun/SLURM/the launcher already did."""
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = self._launcher_cls(self.cluster_environment, self.num_processes, self.num_nodes)

    def add_module_transform(self, transform: Any) -> None:
        """Run ``transform(model)`` on the plain model right before it is sharded (used by the FP8 callback)."""
        self.engine.module_transforms.append(transform)

    def _setup_processes_and_mesh(self) -> Any:
        self._init_process_group()
        return self.engine.setup_mesh(self.world_size, self.root_device, local_size=self.num_processes)

    @staticmethod
    def _reduce_tensor(tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        return self._reduce_tensor(tensor, group, reduce_op)

    all_reduce = reduce  # Fabric's name for it

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    register_strategies = classmethod(register_names)


def layer_sync_request(layer_sync: Any) -> tuple[bool, Optional[Any]]:
    """The Trainer's layer sync (``sync_batchnorm=True``) as (asked, convert): Lightning's own SyncBatchNorm plugin
    is torch's conversion, which the engines make over their data-parallel group (``convert=None``); another
    plugin converts with its own ``apply``."""
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    if layer_sync is None:
        return False, None
    return True, None if isinstance(layer_sync, TorchSyncBatchNorm) else layer_sync.apply


def fsdp2_mixed_precision_class(mixed_cls: type) -> type:
    """A subclass of Lightning's (Trainer or Fabric) ``MixedPrecision`` that keeps loss scaling but drops autocast:
    FSDP2's MixedPrecisionPolicy already runs each block in half precision and reduces gradients in fp32."""
    from contextlib import nullcontext

    class FSDP2MixedPrecision(mixed_cls):  # type: ignore[misc, valid-type]
        def forward_context(self):  # noqa: ANN202
            return nullcontext()

    FSDP2MixedPrecision.__qualname__ = f"FSDP2MixedPrecision[{mixed_cls.__module__.split('.')[1]}]"
    return FSDP2MixedPrecision


def to_fsdp2_precision(plugin: Any, mixed_cls: type, fsdp2_cls: type) -> Any:
    """Swap the AMP plugin Lightning picked for ``*-mixed`` for the FSDP2 one (sharded grad scaler for fp16)."""
    from disttrain.parallel.precision import sharded_grad_scaler

    if isinstance(plugin, mixed_cls) and not isinstance(plugin, fsdp2_cls):
        scaler = sharded_grad_scaler(plugin.device) if plugin.precision == "16-mixed" else None
        return fsdp2_cls(plugin.precision, plugin.device, scaler)
    return plugin


class ZeroPlumbing:
    """What the Trainer and Fabric ZeRO-3 adapters (subclasses of Lightning's DeepSpeed strategies) add, written
    once: CPU support, our config, the CPU-Adam swap, atomic checkpoints, full export."""

    zero_options: Any

    @property
    def root_device(self) -> torch.device:
        # DeepSpeed reads the device index as its device rank (None on CPU would crash `device_rank >= 0`);
        # a CPU device with the local rank as index places tensors on the CPU all the same.
        device = super().root_device  # type: ignore[misc]
        return torch.device("cpu", self.local_rank) if device.type == "cpu" else device

    def _build_zero_config(self, precision: str, micro_batch_size: int, accumulation: int,
                           gradient_clipping: Optional[float]) -> dict:
        from disttrain.parallel.zero import zero3_config

        self._allow_fp16_on_cpu(precision)
        return zero3_config(self.zero_options, precision=precision, micro_batch_size=micro_batch_size,
                            accumulation=accumulation, world_size=self.world_size,
                            gradient_clipping=gradient_clipping, device_type=self.root_device.type)

    def _allow_fp16_on_cpu(self, precision: str) -> None:
        """DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has native fp16 kernels (AVX512-FP16/AMX).
        torch computes fp16 on any CPU, slowly, which is enough for what CPU runs are for: testing a set-up
        (loss scaling, overflow skips) before paying for GPUs. Only CPU runs in fp16 are affected."""
        if self.root_device.type == "cpu" and precision.startswith("16"):
            from deepspeed.accelerator import get_accelerator

            accelerator = get_accelerator()
            if not accelerator.is_fp16_supported():
                accelerator.is_fp16_supported = lambda: True
                accelerator.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]

    def _maybe_cpu_adam(self, optimizer: Any) -> Any:
        from disttrain.parallel.zero import to_cpu_adam

        if optimizer is not None and self.zero_options.use_cpu_adam(self.root_device.type):
            return to_cpu_adam(optimizer)
        return optimizer

    # -- buffers: BatchNorm statistics as DDP keeps them ----------------------------------------------------
    def _prepare_batchnorm(self, module: Any, training: bool, asked: bool = False, convert: Any = None) -> Any:
        """Before the engine: SyncBatchNorm when the option or the Trainer asks (see
        :meth:`disttrain.parallel.engine.FSDPEngine.convert_batchnorm`), refused on CPU for training as ``ddp``
        refuses it. Returns the module to hand to DeepSpeed."""
        from disttrain.parallel.buffers import convert_sync_batchnorm, refuse_sync_batchnorm_on_cpu

        if self.zero_options.sync_batchnorm or asked:
            module = convert(module) if convert is not None else convert_sync_batchnorm(module)
        if training:
            refuse_sync_batchnorm_on_cpu(module, self.root_device, self.strategy_name)  # type: ignore[attr-defined]
        return module

    def _broadcast_buffers(self, module: Any) -> None:
        """Rank 0's buffers to every rank (option ``broadcast_buffers``, on by default), as DDP does."""
        if self.zero_options.broadcast_buffers:
            from disttrain.parallel.buffers import broadcast_buffers

            broadcast_buffers(module)

    def _validate_devices(self) -> None:
        if self.root_device.type == "cuda":  # Lightning's index check is for GPUs only
            from lightning.fabric.strategies.deepspeed import _validate_device_index_selection

            _validate_device_index_selection(self.parallel_devices)
