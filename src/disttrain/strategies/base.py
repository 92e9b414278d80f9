"""The one Trainer adapter base: the Lightning plumbing every ``disttrain_*`` Trainer strategy shares, written once
over the strategy's engine (:mod:`disttrain.parallel.engines.base`). A registered strategy is a short subclass naming its
registered strategy and its engine (whose options dataclass it takes), listed in the package's ``ADAPTERS``::

    class FSDPStrategy(EngineStrategy):
        strategy_name = "disttrain_fsdp"
        engine_cls = FSDPEngine

and an ``__init__`` whose keywords are the dataclass's fields, generated from it (``python
tools/strategy_signatures.py --write`` writes it between two marker lines; tests/test_signatures.py fails when it
differs from the dataclass).

:class:`TrainerAdapter` holds what every adapter does (checkpoint keys of the one layout, clipping, buffers,
``full_model``/``export_full``); :class:`EngineStrategy` puts it over Lightning's ``ParallelStrategy`` for engines
that set models up themselves. DDP and ZeRO-3 put it over Lightning's own strategies (see their modules for why).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Collection, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from typing_extensions import override

from disttrain._lightning import STEP_METHODS, DistributedPlumbing, EngineAdapter, layer_sync_request, \
    split_timeout
from disttrain.parallel.checkpoint.frozen import leave_out_frozen_base
from disttrain.parallel.engines.precision import sharded_grad_scaler
from disttrain.parallel.guards import watchdog

# The checkpoint keys of the one layout for the Trainer: the LightningModule's tensors and each optimizer's.
MODEL_KEY = "state_dict"


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def refuse_callbacks(trainer: "pl.Trainer", strategy_name: str, refused: Mapping[type[Callback], str]) -> None:
    """Stop before training when a callback this strategy cannot serve is attached, with the reason and the way
    out; without it the callback fails deep inside a step (a DTensor or optimizer-type error)."""
    for callback in trainer.callbacks:
        for kind, why in refused.items():
            if isinstance(callback, kind):
                raise MisconfigurationException(f"{type(callback).__name__} cannot run under {strategy_name}: {why}")


# Lightning refuses SWA under its own FSDP and DeepSpeed strategies for the same reason (an isinstance check our
# FSDP-based strategies do not pass, so they say it themselves).
SHARDED_REFUSALS: dict[type[Callback], str] = {
    StochasticWeightAveraging: "it keeps a whole copy of the model and averages the parameters in place, and this"
    " strategy shards them across ranks; use disttrain_ddp for SWA",
}


# How often, in seconds of training, the ranks learn whether rank 0 received SIGTERM (SigtermCheck).
SIGTERM_CHECK_S = 1.0


class SigtermCheck:
    """Lightning's check, at the start of every training step, of whether rank 0 received SIGTERM, made about once a
    second instead of every step.

    Lightning's own (``_TrainingEpochLoop._broadcast_sigterm_tensor``) broadcasts rank 0's flag and reads it back
    before each step: every rank waits for every other once per step, and on a GPU the host waits for the device
    (``.item()``), so the next step's kernels are no longer queued while this one runs. A recommender's steps last
    ~25 ms on 2 CPU processes and the broadcast ~1.4 ms of them (Lightning-AI/pytorch-lightning#21487 measured the GPU
    case). Here rank 0 sends its flag together with the number of steps until the next check, chosen from the
    steps' measured time so that checks come about ``SIGTERM_CHECK_S`` apart: every rank makes the same broadcasts
    at the same steps. A SIGTERM that reaches every process (torchrun and SLURM send it to all) still ends each at
    the end of its current step, by Lightning's own check in each process; the broadcast only tells the others of one
    that rank 0 alone received between two steps, which they now learn at the next check instead of the next step.
    """

    def __init__(self, trainer: "pl.Trainer") -> None:
        self.trainer = trainer
        self.steps = 0  # steps begun (calls), the same count on every rank
        self.next_check = 1
        self.last: Optional[tuple[int, float]] = None  # (steps, time) at the last check

    def __call__(self) -> None:
        self.steps += 1
        if self.steps < self.next_check:
            return
        now = time.monotonic()
        interval = 1
        if self.last is not None and now > self.last[1]:
            per_step = (now - self.last[1]) / (self.steps - self.last[0])
            interval = max(1, int(SIGTERM_CHECK_S / per_step))
        self.last = (self.steps, now)
        message = torch.tensor([int(self.trainer.received_sigterm), interval],
                               device=self.trainer.strategy.root_device)
        try:
            torch.distributed.broadcast(message, src=0)
        except Exception:  # as Lightning's check: a process group that cannot broadcast fails at the next collective
            message = torch.tensor([0, 1])
        received, interval = message.tolist()
        self.next_check = self.steps + interval
        if received:
            with contextlib.suppress(Exception):
                torch.distributed.barrier()  # as Lightning's: every rank leaves together
            raise SIGTERMException()


class TrainerAdapter(EngineAdapter):
    """Mixin (before a Lightning Trainer strategy): what every disttrain Trainer strategy does through its engine."""

    model: Any
    optimizers: list
    lightning_module: Any
    is_global_zero: bool

    def add_module_transform(self, transform: Callable[[torch.nn.Module], None]) -> None:
        """Run ``transform(model)`` on the plain model right before it is parallelised (the FP8 callback)."""
        if not self.engine.takes_module_transforms:
            raise ValueError(f"{self.engine.name} cannot change the model before set-up (DeepSpeed keeps its own"
                             " fp16/bf16 partitions)")
        self.engine.module_transforms.append(transform)

    @override
    def on_train_start(self) -> None:
        loop = self.lightning_module.trainer.fit_loop.epoch_loop
        loop._broadcast_sigterm_tensor = SigtermCheck(self.lightning_module.trainer)  # see SigtermCheck
        super().on_train_start()  # type: ignore[misc]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        watchdog.set_step(f"training step {self.lightning_module.global_step}")  # for a stalled rank's report
        self.engine.prepare_step(self.model)
        output = super().training_step(*args, **kwargs)  # type: ignore[misc]
        self.engine.broadcast_buffers(self.model)  # rank 0's BatchNorm statistics, as under ddp
        return output

    def full_model(self) -> AbstractContextManager[torch.nn.Module]:
        """Collective, on every rank: ``with trainer.strategy.full_model(): y = module.model(x)``. Inside the block
        every rank holds the full parameters and the LightningModule, or any part of it, can be called on any rank
        (rank 0 alone too) without communication, under ``torch.no_grad()``; shards are restored on exit. For use
        after ``trainer.fit`` (a notebook, an evaluation script); yields the LightningModule."""
        if self.model is None:
            raise RuntimeError("full_model() needs the model trainer.fit/validate/test/predict set up: call it after"
                               " one of them")
        return self.engine.full_model(self.lightning_module)

    def export_full(self, path: Any, prefix: str = "") -> Path:
        """Write the full model as one safetensors file (rank 0). ``prefix="model."`` keeps only the keys under
        ``self.model`` of the LightningModule, without the prefix, so they load into that plain module."""
        return self.engine.export(self.lightning_module, path, prefix=prefix)

    def load_pretrained(self, folder: Any, prefix: str = "model.", partial: bool = False,
                        exclude: Collection[str] = ()) -> list[str]:
        """Collective, after setup (e.g. in ``on_fit_start``): a Hugging Face folder's (or one safetensors file's)
        weights into the LightningModule's model at ``prefix`` (``self.model``), each rank reading only its own slices
        of the safetensors files into its shards (:mod:`disttrain.parallel.checkpoint.pretrained`); ``partial``: only the tensors
        the folder has; ``exclude``: stored tensor names left at their initialisation (a new classifier head)."""
        return self.engine.load_pretrained(self.model, folder, prefix=prefix, partial=partial, exclude=exclude)

    # -- checkpoints: the one layout (DCP folders by parameter name), which every disttrain strategy loads -------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the shards and optimizers must exist to be restored in place

    @property
    def lightning_restore_optimizer(self) -> bool:
        if getattr(self, "_restored_in_place", False):
            return not self.engine.optimizers_by_name  # else load_checkpoint restored them in place
        return super().lightning_restore_optimizer  # type: ignore[misc]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return self.engine.model_state(self.model)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if not self.engine.optimizers_by_name:
            return super().optimizer_state(optimizer)  # type: ignore[misc]
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return self.engine.optimizer_state(self.model, optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options; it writes"
                            " torch.distributed.checkpoint folders itself")
        tensors = {MODEL_KEY: checkpoint.pop(MODEL_KEY)}
        if self.engine.optimizers_by_name:
            tensors.update({optimizer_key(i): s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        leave_out_frozen_base(tensors, checkpoint, {MODEL_KEY: self.model})  # a LoRA run's base stays in its folder
        self.engine.save_checkpoint(self.broadcast(filepath), self.model, tensors, checkpoint)  # type: ignore

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A disttrain checkpoint of any strategy and world size is restored in place, and so is one Lightning's own
        strategies wrote (``disttrain.checkpoint_loading``); what the engine does not read (single files under
        disttrain_ddp, DeepSpeed folders under disttrain_zero3) is loaded as Lightning loads it."""
        path = self.broadcast(checkpoint_path)  # type: ignore[attr-defined]
        self.engine.wait_checkpoint()  # a checkpoint written in the background exists once it is complete
        self._restored_in_place = self.engine.reads_checkpoint(path)
        if not self._restored_in_place:
            return super().load_checkpoint(path, weights_only=weights_only)  # type: ignore[misc]
        targets: dict[str, Any] = {MODEL_KEY: self.model}
        if self.engine.optimizers_by_name:
            targets.update({optimizer_key(i): opt for i, opt in enumerate(self.optimizers)})
        source = self._lightning_checkpoint(path, self.model, targets, trainer=True, weights_only=weights_only)
        return self.engine.load_checkpoint(path, self.model, targets, strict=self.lightning_module.strict_loading,
                                           weights_only=weights_only, source=source)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not getattr(self, "_restored_in_place", False):
            super().load_model_state_dict(checkpoint, strict=strict)  # type: ignore[misc]

    def remove_checkpoint(self, filepath: Any) -> None:
        self.engine.wait_checkpoint(filepath)  # only when it is the one being written (async_checkpoint)
        if self.is_global_zero:
            path = Path(filepath)
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


class ClipByEngine:
    """Trainer clipping by the whole model's norm. The Trainer clips through its precision plugin (the module's
    ``configure_gradient_clipping`` calls ``precision_plugin.clip_gradients``), never through the strategy, and
    torch's clip would see only this rank's pipeline stage (or fail on TP's two meshes): the plugins of the
    engine-backed strategies ask the engine instead."""

    strategy: Optional["EngineStrategy"] = None

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
        if self.strategy is None:
            return super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]
        self.strategy.engine.clip_grad_norm_(self.strategy.model, self.main_params(optimizer), clip_val)  # type: ignore


class EnginePrecision(ClipByEngine, Precision):
    """``32-true``."""


class EngineHalfPrecision(ClipByEngine, HalfPrecision):
    """``16-true`` / ``bf16-true``: the module itself in half precision."""


class EngineMixedPrecision(ClipByEngine, MixedPrecision):
    """``16-mixed`` / ``bf16-mixed`` with autocast, for engines that do not cast themselves."""


class FSDP2MixedPrecision(EngineMixedPrecision):
    """``*-mixed`` under FSDP2: loss scaling kept, autocast dropped (the MixedPrecisionPolicy already runs each block
    in half precision and reduces gradients in fp32)."""

    @override
    def forward_context(self) -> AbstractContextManager:
        return nullcontext()


class EngineStrategy(TrainerAdapter, DistributedPlumbing, ParallelStrategy):
    """The base of the Trainer strategies whose engine sets models up (FSDP, Megatron, recsys); CUDA (nccl) and
    CPU (gloo). Subclasses set ``strategy_name`` and ``engine_cls``; their ``__init__``, generated from the engine's
    options dataclass (tools/strategy_signatures.py), takes its options as keywords and calls :meth:`_init_adapter`."""

    _launcher_cls = _SubprocessScriptLauncher

    def _init_adapter(self, accelerator: Optional[Any], parallel_devices: Optional[list[torch.device]],
                      cluster_environment: Optional[Any], precision_plugin: Optional[Precision],
                      process_group_backend: Optional[str], timeout: Any, options: dict[str, Any]) -> None:
        self._init_engine(options)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin)
        self._process_group_backend = process_group_backend
        self._watchdog_timeout, self._timeout = split_timeout(timeout)

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else self._engine_precision(Precision())

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # None stays None: the Trainer takes a strategy's own plugin for the user's and would ignore its precision=.
        self._precision_plugin = self._engine_precision(plugin) if plugin is not None else None

    def _engine_precision(self, plugin: Precision) -> Precision:
        """Lightning's plugin for the precision as the engine's: clipping through the engine, and no autocast for an
        engine that casts itself (FSDP2, with the sharded grad scaler for fp16). A plugin of the user's own class
        is kept as it is."""
        if isinstance(plugin, MixedPrecision) and not isinstance(plugin, ClipByEngine):
            casts = self.engine.casts_itself
            scaler = sharded_grad_scaler(plugin.device) if casts and plugin.precision == "16-mixed" else plugin.scaler
            plugin = (FSDP2MixedPrecision if casts else EngineMixedPrecision)(plugin.precision, plugin.device, scaler)
        elif type(plugin) is HalfPrecision:
            plugin = EngineHalfPrecision(plugin.precision)
        elif type(plugin) is Precision:
            plugin = EnginePrecision()
        if isinstance(plugin, ClipByEngine):
            plugin.strategy = self
        return plugin

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = self.engine.mesh  # in configure_model as self.device_mesh

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        refuse_callbacks(trainer, self.strategy_name, SHARDED_REFUSALS)
        if fitting:
            self.engine.check_accumulation(trainer.accumulate_grad_batches)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        asked, convert = layer_sync_request(self._layer_sync)
        self.model, _ = self.engine.setup(self.model, self.root_device, self.precision_plugin.precision,
                                          container=True, training=fitting, forward_methods=STEP_METHODS,
                                          sync_batchnorm=asked, convert=convert)
        self.barrier()
        if fitting:
            self._reset_optimizers_and_schedulers()  # a re-setup must not keep optimizers of the old parameters
            self.setup_optimizers(trainer)
            self.engine.check_optimizers(self.model, self.optimizers)
            self.engine.settle_optimizers(self.optimizers)
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        pass  # setup() placed the model (or its shards)

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        with self.engine.init_context(empty_init), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient synchronisation on the non-final micro-steps of gradient accumulation."""
        with self.engine.no_sync(self.model):
            yield

    @override
    def on_train_end(self) -> None:
        self.engine.wait_checkpoint()  # the run's last checkpoint (async_checkpoint) is complete when fit returns
        super().on_train_end()

    def teardown(self) -> None:
        self.engine.wait_checkpoint()
        # The module stays where the engine put it (shards are not moved to the CPU as Lightning's teardown would).
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
