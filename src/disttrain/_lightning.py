"""Lightning-side plumbing shared by the Trainer and Fabric adapters (both subclass a ``ParallelStrategy`` with
the same attribute names): process-group start and clean exit, ranks, launcher, sampler, collectives."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import inspect
import os
import sys
import time
from collections.abc import Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Optional, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from disttrain.parallel import registry
from disttrain.parallel.engines.base import Engine
from disttrain.parallel.engines.deepspeed import (
    hf_init_after_partitioning,
    import_dynamo_before_zero_init,
    keep_decorated_inits,
    no_broadcast_of_uninitialised_weights,
    trim_while_partitioning,
)
from disttrain.parallel.guards import watchdog
from disttrain.parallel.options import OptionError, UnknownOptionError, as_option_error
from disttrain.patches import skip_deepspeed_shm_op

# Seconds a rank may stay silent (its heartbeat) before every other rank ends the run (parallel/guards/watchdog.py); the
# process group's collectives wait a few heartbeats longer. Lightning waits 30 minutes, with no word of which rank;
# a checkpoint save or a step that takes longer needs a larger ``timeout=``.
DEFAULT_TIMEOUT: float = 600.0
# Methods the Trainer and Fabric call on a LightningModule instead of ``forward``: engines that gather parameters
# around ``forward`` (FSDP2) gather around these too.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
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
    watchdog.stop()  # its thread must not be inside a store call when the interpreter finalizes
    if dist.is_available() and dist.is_initialized() and getattr(sys, "last_value", None) is None:
        dist.destroy_process_group()
    if _gloo_workers_alive():
        time.sleep(_EXIT_GRACE_S)


def register_clean_exit() -> None:
    """Install :func:`destroy_process_groups_on_clean_exit` for this process (once); every adapter calls it right
    after it created the process group."""
    atexit.unregister(destroy_process_groups_on_clean_exit)  # no-op the first time: keeps one registration
    atexit.register(destroy_process_groups_on_clean_exit)


TIMEOUT_ENV = "DISTTRAIN_TIMEOUT"


def split_timeout(timeout: Any) -> tuple[float, timedelta]:
    """An adapter's ``timeout=`` (seconds or a timedelta; None: ``$DISTTRAIN_TIMEOUT``, which a strategy given by
    name takes, else :data:`DEFAULT_TIMEOUT`) as (the watchdog's seconds, the process group's timeout)."""
    if timeout is None and os.environ.get(TIMEOUT_ENV):
        try:
            seconds = watchdog.seconds(os.environ[TIMEOUT_ENV])
        except ValueError as e:
            raise ValueError(f"{TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]!r}: {e}") from None
    else:
        seconds = watchdog.seconds(DEFAULT_TIMEOUT if timeout is None else timeout)
    return seconds, watchdog.collective_timeout(seconds)


def after_process_group(strategy: Any) -> None:
    """What every adapter does right after its process group exists: the clean exit, and the watchdog that ends
    the run when a rank stops answering."""
    register_clean_exit()
    watchdog.start(getattr(strategy, "_watchdog_timeout", DEFAULT_TIMEOUT), label=strategy.strategy_name,
                   advice="the checkpoints written so far are intact: resume from the last one")


Init = TypeVar("Init", bound=Callable[..., None])


def checked_options(init: Init) -> Init:
    """The ``__init__`` of an adapter, whose keywords are its options: a keyword it does not take is the options'
    own error (the closest option, or the strategy whose option it is: :meth:`EngineAdapter.refuse_options`) instead
    of Python's bare "unexpected keyword argument". The signature stays ``init``'s (``inspect.signature``, ``help()``,
    Sphinx and jsonargparse follow ``__wrapped__``; type checkers see ``init``'s type), so it lists every option."""
    accepted = set(inspect.signature(init).parameters)

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        other = {key: kwargs.pop(key) for key in list(kwargs) if key not in accepted}
        if other:
            type(self).refuse_options(other)  # raises, unless each is another strategy's option left at its default
        init(self, *args, **kwargs)

    return checked  # type: ignore[return-value]


class EngineAdapter:
    """What every adapter (Trainer and Fabric) holds: the strategy's engine, built from the options. A subclass
    names its registered strategy (``strategy_name``) and engine (``engine_cls``); the options dataclass is the
    engine's, and the subclass's ``__init__`` takes its fields as keywords (generated from the dataclass by
    tools/strategy_signatures.py), except ``options_from_elsewhere``."""

    strategy_name: str
    engine_cls: type[Engine]
    # Options of the dataclass this entry point takes from elsewhere: {option: "a Fabric option of ...: under the
    # Trainer it comes from ..."}, refused as keywords with that clause.
    options_from_elsewhere: ClassVar[Mapping[str, str]] = {}
    parallel_devices: Optional[list[torch.device]]
    num_nodes: int

    @classmethod
    def refuse_options(cls, given: dict[str, Any]) -> None:
        """Keywords ``__init__`` does not take: one error naming the closest option (or the strategy whose option it
        is, or what to pass instead of a Lightning strategy's option). An option this strategy cannot serve, given at
        its default (``compile=False`` on disttrain_zero3), asks for nothing and passes."""
        for name, why in cls.options_from_elsewhere.items():
            if name in given:
                raise UnknownOptionError(f"{name}={given[name]!r} is {why}; remove {name}")
        try:
            registry.lookup(cls.strategy_name).options(**given)
        except (TypeError, ValueError) as e:
            raise as_option_error(e) from None

    def _init_engine(self, options: dict[str, Any]) -> None:
        """Called first in every adapter's ``__init__``: the engine exists before Lightning sets the precision. A
        None given for an option whose default is built (a dict) is that default."""
        self.engine = self.engine_cls(self._options(registry.lookup(self.strategy_name), options), self.strategy_name)

    @staticmethod
    def _options(row: registry.Registered, options: dict[str, Any]) -> Any:
        built = {f.name for f in dataclasses.fields(row.options_cls) if f.default_factory is not dataclasses.MISSING}
        try:
            return row.options(**{k: v for k, v in options.items() if not (v is None and k in built)})
        except (TypeError, ValueError) as e:
            raise as_option_error(e) from None  # the message is the whole story: one line, not two tracebacks

    def check_world(self) -> None:
        """The sizes the options ask for against the world Lightning set up (devices x nodes), before any process
        starts: the engine's own sentence, prefixed with the devices and nodes, as one :class:`OptionError`."""
        processes = len(self.parallel_devices or ())
        if not processes:
            return
        nodes = self.num_nodes
        try:
            self.engine_cls.parallel_dims(self.engine.options, processes * nodes, processes)
        except ValueError as e:
            raise OptionError(f"{self.strategy_name} cannot run on devices={processes} x num_nodes={nodes}"
                              f" ({processes * nodes} processes): {e}") from None

    def _configure_launcher(self) -> None:
        # Lightning's connector calls this inside Trainer(...)/Fabric(...), once devices and nodes are known and before
        # any launcher starts processes: the one moment to refuse sizes the world cannot hold.
        self.check_world()
        super()._configure_launcher()  # type: ignore[misc]

    def set_async_checkpoint(self, enabled: bool = True) -> None:
        """The option ``async_checkpoint`` on a strategy already built (one a launcher or a Trainer/Fabric name
        made), checked as the option is: a strategy that cannot save in the background refuses in one line."""
        options = self.engine.options
        if not any(f.name == "async_checkpoint" for f in dataclasses.fields(options)):
            raise ValueError(f"async_checkpoint is not an option of {self.strategy_name}; checkpoints are written in the"
                             " background by disttrain_fsdp, disttrain_ddp and disttrain_megatron")
        new = dataclasses.replace(options, async_checkpoint=enabled)  # refused in one line where it cannot work
        self.engine.wait_checkpoint()  # a synchronous save never runs beside a background one
        self.engine.options = new

    def _lightning_checkpoint(self, path: Any, module: Any, targets: dict[str, Any], trainer: bool,
                              weights_only: Optional[bool]) -> Any:
        """``path`` as the engine reads it when Lightning's own strategy wrote it (``source=`` of the engine's
        ``load_checkpoint``), else None (disttrain's own checkpoints)."""
        from torch import nn

        from disttrain.checkpoint_loading import open_lightning_checkpoint, parameter_order

        model_key = next(key for key, value in targets.items() if isinstance(value, nn.Module))
        optimizer_keys = [key for key in targets if key != model_key]

        def order(key: str) -> tuple[list[str], dict[str, tuple[int, ...]]]:
            return parameter_order(self.engine.optimizer_state(module, targets[key]), self.engine.model_state(module))

        return open_lightning_checkpoint(path, model_key, optimizer_keys, trainer, order, self.engine.name,
                                         weights_only is not False)


class DeepSpeedPlumbing(EngineAdapter):
    """Mixin (before Lightning's Trainer or Fabric ``DeepSpeedStrategy``): what both ZeRO adapters do alike over
    the ZeRO engine: its options, its device (CPU too), where modules are built, and starting DeepSpeed's process
    group."""

    local_rank: int
    parallel_devices: Optional[list[torch.device]]

    def _split_timeout(self, timeout: Any) -> timedelta:
        """Keep the watchdog's seconds of ``timeout=``; returns DeepSpeed's process-group timeout."""
        self._watchdog_timeout, collective = split_timeout(timeout)
        return collective

    def _deepspeed_init_kwargs(self, options: dict[str, Any]) -> dict[str, Any]:
        """Build the engine from ``options``; returns the keywords for Lightning's ``DeepSpeedStrategy.__init__``
        (its own config is built later by the engine, from the Trainer/Fabric settings)."""
        self._init_engine(options)
        options = self.engine.options
        return {"stage": options.stage, "config": {}, "remote_device": options.offload_parameters}

    @property
    def root_device(self) -> torch.device:
        return self.engine.device_for(super().root_device, self.local_rank)  # type: ignore[misc]

    # Where modules are built. ZeRO-3: Lightning's zero.Init contexts (Fabric's module_sharded_context, the Trainer's
    # model_sharded_context), with Hugging Face models initialised as transformers does under ZeRO-3, memory freed by
    # partitioning given back as it goes, no broadcast of weights left uninitialised for a load, torch._dynamo
    # imported before (a first import inside fails), and classes first defined inside keep their decorators
    # (parallel/engines/deepspeed.py explains all five). Below stage 3
    # modules are built as usual, initialised: ``empty_init=True`` (which disttrain recipes pass for every disttrain
    # strategy) would leave Lightning's uninitialised memory there.
    def module_sharded_context(self) -> AbstractContextManager:
        if not self.engine.builds_partitioned:
            return super().module_sharded_context()  # type: ignore[misc]
        import_dynamo_before_zero_init()
        stack = ExitStack()
        stack.enter_context(keep_decorated_inits())  # restored after zero.Init has closed
        stack.enter_context(hf_init_after_partitioning())  # initialises after zero.Init has closed
        stack.enter_context(trim_while_partitioning())
        stack.enter_context(no_broadcast_of_uninitialised_weights())
        stack.enter_context(super().module_sharded_context())  # type: ignore[misc]
        return stack

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        if not self.engine.builds_partitioned:
            with super().model_sharded_context():  # type: ignore[misc]
                yield
            return
        import_dynamo_before_zero_init()
        with keep_decorated_inits(), hf_init_after_partitioning(), trim_while_partitioning(), \
                no_broadcast_of_uninitialised_weights(), super().model_sharded_context():  # type: ignore[misc]
            yield

    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:  # Fabric's
        return super().module_init_context(self._empty_init(empty_init))  # type: ignore[misc]

    def tensor_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        return super().tensor_init_context(self._empty_init(empty_init))  # type: ignore[misc]

    def _empty_init(self, empty_init: Optional[bool]) -> Optional[bool]:
        return empty_init if self.engine.builds_partitioned else None

    def _start_deepspeed(self, set_world_ranks: Any) -> None:
        """Lightning's DeepSpeed start-up (seed, ranks, DeepSpeed's process group) on CPU as on CUDA."""
        validate_gpu_indices(self.parallel_devices)
        reset_seed()
        set_world_ranks()
        skip_deepspeed_shm_op()
        self._init_deepspeed_distributed()  # type: ignore[attr-defined]
        after_process_group(self)


class DistributedPlumbing:
    """Mixin for the adapters over a Lightning ``ParallelStrategy`` (Trainer or Fabric) whose engine sets models up:
    process group, ranks, launcher, sampler, collectives, written once for both entry points."""

    engine: Engine
    parallel_devices: Optional[list[torch.device]]
    _process_group_backend: Optional[str] = None
    _timeout: Optional[timedelta] = None  # set by each adapter's __init__ (split_timeout)
    _launcher_cls: type  # the Trainer's or Fabric's _SubprocessScriptLauncher
    _num_nodes: int = 1  # Fabric's connector sets _num_nodes, the Trainer's num_nodes

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

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

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Also before the processes start (a recipe sizing its global batch): the degrees the options will give.
        return self.engine.sampler_kwargs(self.num_nodes * self.num_processes or None, self.global_rank)

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]  (the Lightning strategy after this mixin)
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or \
            _get_default_process_group_backend_for_device(self.root_device)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                              device_id=device_id)
        after_process_group(self)
        self.engine.setup_mesh(self.world_size, self.root_device, local_size=self.num_processes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    _set_world_ranks = set_world_ranks  # Fabric's name

    def _configure_launcher(self) -> None:
        """Start the other local processes ourselves unless torchrun/SLURM/the launcher already did."""
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = self._launcher_cls(self.cluster_environment, self.num_processes, self.num_nodes)

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        return self.engine.reduce(tensor, reduce_op, group)

    all_reduce = reduce  # Fabric's name for it

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's vote (checkpoint, early-stopping and spike decisions) over every process: ``reduce`` may
        combine only the data-parallel ranks (disttrain_megatron), which Lightning's count against the world size
        would read as a missing vote."""
        if not (dist.is_available() and dist.is_initialized()):
            return decision
        votes = self.engine.reduce(torch.tensor(int(decision), device=self.root_device), "sum", dist.group.WORLD)
        return bool(votes == self.world_size) if all else bool(votes)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.engine.barrier(self.root_device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]


def validate_gpu_indices(devices: Optional[list[torch.device]]) -> None:
    """Lightning's check that DeepSpeed's CUDA devices are numbered from 0 (CPU devices have no such rule)."""
    if devices and devices[0].type == "cuda":
        from lightning.fabric.strategies.deepspeed import _validate_device_index_selection

        _validate_device_index_selection(devices)


class AutoResolution:
    """``disttrain_auto`` at both entry points: it stands in as our DDP strategy until the planner has chosen, then
    becomes the chosen strategy. Lightning keeps the strategy object it was given (the Trainer reads it from its
    connector at every use, Fabric holds it from the start) and offers no later hook to swap it, so this object
    takes the chosen strategy's class and state: every reference Lightning holds is the chosen strategy from then
    on. It resolves at the first moment the model is known: in ``_configure_launcher`` (the devices are known
    there) when ``model=`` is given, else in the Trainer's ``connect(model)``. Subclasses name the entry point's
    registry and precision attribute."""

    strategy_name = "disttrain_auto"
    _lightning_registry: Any  # the Trainer's or Fabric's strategy registry
    _precision_attr: str  # "precision_plugin" (Trainer) or "precision" (Fabric)
    auto_options: Any
    plan: Any = None

    def _init_engine(self, options: dict[str, Any]) -> None:
        self.auto_options = EngineAdapter._options(registry.AUTO, options)
        self.engine = self.engine_cls(self.engine_cls.options_cls(), self.strategy_name)  # the stand-in's own

    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # type: ignore[misc]
        if self.auto_options.model is not None:
            self._resolve(self.auto_options.model)

    def _resolve(self, source: Any) -> None:
        chosen = choose_strategy(self, self.auto_options, source, self._lightning_registry, self._precision_attr)
        self.__class__ = type(chosen)
        self.__dict__ = chosen.__dict__


def choose_strategy(stand_in: Any, options: Any, source: Any, lightning_registry: Any, precision_attr: str) -> Any:
    """What ``disttrain_auto`` runs as: the planner's choice for ``source`` (a module, a recipe YAML, its ``model:``
    dict) on the devices of ``stand_in`` (the auto strategy as Lightning set it up), built from
    ``lightning_registry`` (the Trainer's or Fabric's) with the plan's options and everything Lightning had set on
    the stand-in: accelerator, devices, cluster environment, precision (``precision_attr``: "precision_plugin" or
    "precision"), layer sync and launcher. The planner's report is its ``plan``."""
    from disttrain.planner.runtime import plan_for

    devices = stand_in.parallel_devices
    plugin = getattr(stand_in, precision_attr)
    plan = plan_for(source, options, stand_in.num_nodes * len(devices), stand_in.root_device, plugin.precision,
                    gpus_per_node=len(devices), available=list(lightning_registry))
    if stand_in.global_rank == 0:
        print(f"disttrain_auto:\n{plan.report()}", flush=True)
    entry = lightning_registry[plan.strategy]
    chosen = entry["strategy"](**{**entry["init_params"], **plan.choice.strategy_options(),
                                  "timeout": getattr(stand_in, "_watchdog_timeout", None)})
    chosen.accelerator = stand_in.accelerator
    chosen.parallel_devices = devices
    chosen.cluster_environment = stand_in.cluster_environment
    chosen.num_nodes = stand_in.num_nodes
    if hasattr(chosen, "_layer_sync"):
        chosen._layer_sync = getattr(stand_in, "_layer_sync", None)  # the Trainer's sync_batchnorm=True
    setattr(chosen, precision_attr, _deepspeed_precision_for(chosen, plugin))
    (getattr(chosen, "set_world_ranks", None) or chosen._set_world_ranks)()
    chosen._configure_launcher()
    if stand_in._launcher is not None and chosen._launcher is not None:
        chosen._launcher = stand_in._launcher  # the processes may already have been started by this one
    chosen.plan = plan
    return chosen


def _deepspeed_precision_for(strategy: Any, plugin: Any) -> Any:
    """Lightning's DeepSpeed strategies need their own precision plugin, which Lightning picks by ``isinstance``
    when it builds the Trainer/Fabric: before the auto strategy has chosen."""
    from lightning.fabric.plugins.precision import DeepSpeedPrecision as FabricDeepSpeedPrecision
    from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision
    from lightning.pytorch.strategies import DeepSpeedStrategy

    for strategy_cls, precision_cls in ((DeepSpeedStrategy, DeepSpeedPrecision),
                                        (FabricDeepSpeedStrategy, FabricDeepSpeedPrecision)):
        if isinstance(strategy, strategy_cls) and not isinstance(plugin, precision_cls):
            return precision_cls(plugin.precision)
    return plugin


def layer_sync_request(layer_sync: Any) -> tuple[bool, Optional[Any]]:
    """The Trainer's layer sync (``sync_batchnorm=True``) as (asked, convert): Lightning's own SyncBatchNorm plugin
    is torch's conversion, which the engines make over their data-parallel group (``convert=None``); another
    plugin converts with its own ``apply``."""
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    if layer_sync is None:
        return False, None
    return True, None if isinstance(layer_sync, TorchSyncBatchNorm) else layer_sync.apply
