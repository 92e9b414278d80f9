"""``disttrain_ddp`` for the Lightning Trainer: Lightning's DDP over our DDP engine (compression hooks on CPU too,
the one checkpoint layout)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from torch import nn

from disttrain._lightning import after_process_group, split_timeout
from disttrain.parallel.engines.ddp import DDPEngine
from disttrain.strategies.base import TrainerAdapter


# Lightning's DDPStrategy stays the base: the Trainer accepts a torch.compile'd module only under its DDP, FSDP or
# single-device strategies (an isinstance check), and for manual optimization its DDP strategy prepares DDP's
# reducer (prepare_for_backward, the forward redirection, the static-graph flush) and unwraps the model at teardown.
class DDPStrategy(TrainerAdapter, LightningDDPStrategy):
    """DDP for ``lightning.Trainer``. Options (:class:`disttrain.parallel.engines.ddp.DDPOptions`): ``gradient_compression``
    ("fp16", "bf16", "powersgd"), ``powersgd_rank``, ``powersgd_start_iter``, ``find_unused_parameters``,
    ``static_graph``. Lightning's own hooks only register on CUDA; ours also on CPU."""

    strategy_name = "disttrain_ddp"
    engine_cls = DDPEngine

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 precision_plugin: Any = None, process_group_backend: Any = None, timeout: Any = None,
                 **options: Any) -> None:
        self._init_engine(options)
        self._watchdog_timeout, collective = split_timeout(timeout)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=collective,
                         **self.engine.options.ddp_kwargs())

    def setup_distributed(self) -> None:
        super().setup_distributed()
        after_process_group(self)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return self.engine.setup(model, self.root_device, self.precision_plugin.precision)[0]

    def _register_ddp_hooks(self) -> None:
        pass  # the engine installed the compression hook when it wrapped the model
