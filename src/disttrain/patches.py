"""Every change disttrain makes to a third-party library that outlives the call making it, in one place.

Each patch says what upstream does, why disttrain cannot live with it, and what it changes; each is installed where it
is needed (``import disttrain``, the first process group, a DeepSpeed config), never on a mere import of this module,
which imports no library at module level. ``tests/test_patches.py`` checks, for each, that upstream still behaves the
way the patch works around: when a release changes that behaviour, that test fails and the patch can go.

====================================  ===========================================================================
patch                                 works around
====================================  ===========================================================================
:func:`when_lightning_loads`          Lightning has no plugin hook for strategy names (an import-system finder
                                      that runs a callback right after ``import lightning``)
:func:`register_on_first_read`        ... and importing it eagerly would triple the start-up of every command (a
                                      registry registers disttrain's names the first time anything reads it)
:func:`suggest_strategy_names`        Lightning's error for an unknown strategy name suggests no name (and knows
                                      only its own examples)
:func:`read_checkpoint_folders`       ``LightningModule.load_from_checkpoint`` opens its path as one file
:func:`allow_setup_optimizers_after`  Fabric refuses ``setup_optimizers`` for every DeepSpeed strategy
:func:`skip_deepspeed_shm_op`         DeepSpeed JIT-compiles an inference-only op when its backend starts on CPU
:func:`allow_fp16_on_deepspeed_cpu`   DeepSpeed's CPU accelerator refuses fp16 without AVX512-FP16/AMX
:func:`count_all_to_all`              torch.distributed has no hook that sees the tensors a gloo all-to-all sends
:func:`remember_missing_nvml`         torch.cuda looks for the NVIDIA management library again at every
                                      ``is_available()`` under Lightning, on machines that have none
====================================  ===========================================================================
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from typing import Any, Callable

# -- Lightning: strategy names, without importing Lightning ------------------------------------------------------


def when_lightning_loads(callback: Callable[[], None]) -> None:
    """``callback()`` right after Lightning's package has run: now if it already has, else from a finder in
    ``sys.meta_path`` that answers for the one module name ``lightning`` (then removes itself). Installed once."""
    if "lightning" in sys.modules:
        callback()
    elif not any(type(finder).__name__ == "_WhenLightningLoads" for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenLightningLoads(callback))


class _WhenLightningLoads(importlib.abc.MetaPathFinder):
    """Finds no module itself: for ``lightning`` alone it returns the spec the other finders give, with a loader
    that calls the callback once Lightning's package has run; then this finder leaves ``sys.meta_path``."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "lightning":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenCall(spec.loader, self.callback)
        return spec


class _ThenCall:
    """Lightning's own loader (every other attribute is its), whose ``exec_module`` calls the callback after the
    package ran."""

    def __init__(self, loader: Any, callback: Callable[[], None]) -> None:
        self.loader = loader
        self.callback = callback

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__spec__.loader = module.__loader__ = self.loader  # the package's own loader from here on
        self.loader.exec_module(module)
        self.callback()


# Every way Lightning and its users read a strategy registry (a dict subclass). tests/test_patches.py checks that
# Lightning's registry classes define no other public method.
REGISTRY_READS = ("__contains__", "__getitem__", "__iter__", "__len__", "__repr__", "__str__", "available_strategies",
                  "get", "items", "keys", "register", "remove", "values")


def register_on_first_read(registry: dict, register: Callable[[], Any]) -> None:
    """Until it is first read, ``registry`` is of a subclass of its own class whose reads call ``register()``, put
    the registry's class back, then read it as usual. Registration waits for that first read because Lightning is
    often first imported by one of disttrain's own adapter modules, whose import is not finished at that moment."""
    own = type(registry)
    if getattr(own, "_disttrain_pending", False):
        return

    def first(method: str) -> Any:
        def read(self: dict, *args: Any, **kwargs: Any) -> Any:
            self.__class__ = own
            register()
            return getattr(own, method)(self, *args, **kwargs)

        return read

    registry.__class__ = type(own.__name__, (own,),
                              {"_disttrain_pending": True, **{m: first(m) for m in REGISTRY_READS}})


# The start of the error both of Lightning's connectors raise for a strategy name no registry holds.
INVALID_STRATEGY = "You selected an invalid strategy name"


def suggest_strategy_names(error_for: Callable[[str, list[str], str], Any]) -> None:
    """``Trainer(strategy=NAME)`` and ``Fabric(strategy=NAME)`` with a name no registry holds: the error
    ``error_for(NAME, registered names, Lightning's message)`` returns (one naming the closest name), or Lightning's
    own when it returns None (idempotent).

    Both connectors check the name in ``_check_config_and_set_final_flags`` against a list they read from their
    registry and raise a ValueError that lists a few of Lightning's own names ("Example choices: auto, ddp, ...") and
    none of the registered ones, with no suggestion. That method is wrapped: it runs unchanged, and only that one
    error, for a string, is replaced; every other check and error of the method stays Lightning's."""
    from lightning.fabric.connector import _Connector
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    for connector in (_Connector, _AcceleratorConnector):
        lightning_check = connector._check_config_and_set_final_flags
        if getattr(lightning_check, "_suggests_names", False):
            continue

        @functools.wraps(lightning_check)
        def check(self: Any, *args: Any, _lightning_check: Callable[..., None] = lightning_check,
                  **kwargs: Any) -> None:
            try:
                _lightning_check(self, *args, **kwargs)
            except ValueError as e:
                name = getattr(self, "_strategy_flag", None)
                if not (str(e).startswith(INVALID_STRATEGY) and isinstance(name, str)):
                    raise
                better = error_for(name, list(self._registered_strategies), str(e))
                if better is None:
                    raise
                raise better from None

        check._suggests_names = True  # type: ignore[attr-defined]
        connector._check_config_and_set_final_flags = check


def read_checkpoint_folders(is_folder: Callable[[Any], bool], read: Callable[..., Any]) -> None:
    """``LightningModule.load_from_checkpoint`` / ``LightningDataModule.load_from_checkpoint`` read disttrain
    checkpoint folders (idempotent): paths ``is_folder`` accepts go to ``read(path, map_location, weights_only)``.

    Both read the path with the name ``pl_load`` in ``lightning.pytorch.core.saving`` (Fabric's ``_load``), which
    opens it as one file: a folder fails with IsADirectoryError. No Trainer or strategy exists at that point, so
    Lightning offers no hook; that one module-level name is rebound instead. Every other path (files, URLs, streams,
    other folders) goes to Lightning's function unchanged, and nothing else in Lightning (the Trainer's resume,
    Fabric's load, other modules importing ``_load``) is touched."""
    from lightning.pytorch.core import saving

    if getattr(saving.pl_load, "_reads_disttrain_folders", False):
        return
    lightning_load = saving.pl_load

    @functools.wraps(lightning_load)
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if is_folder(path_or_url):
            return read(path_or_url, map_location, weights_only)
        return lightning_load(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load._reads_disttrain_folders = True  # type: ignore[attr-defined]
    saving.pl_load = pl_load


def allow_setup_optimizers_after(strategy_cls: type) -> None:
    """``fabric.setup_optimizers`` after ``fabric.setup_module`` for strategies of ``strategy_cls`` (disttrain's ZeRO
    Fabric strategy, which attaches the optimizer to the engine ``setup_module`` made). Fabric refuses it for every
    DeepSpeed strategy, because Lightning's needs the model and the optimizer in one call; for ``strategy_cls``
    Fabric's other checks (launched, at least one optimizer, not set up twice, no meta tensors) still run, and every
    other strategy keeps Fabric's validation as it is. Installed once, when the first process group starts."""
    from lightning.fabric import Fabric

    original = Fabric._validate_setup_optimizers
    if getattr(original, "_disttrain_allows", None) is strategy_cls:
        return

    @functools.wraps(original)
    def validate(fabric: Any, optimizers: Any) -> None:
        strategy = fabric._strategy
        if not isinstance(strategy, strategy_cls):
            return original(fabric, optimizers)
        fabric._strategy = None  # a strategy of no particular kind: Fabric checks all but the DeepSpeed refusal
        try:
            return original(fabric, optimizers)
        finally:
            fabric._strategy = strategy

    validate._disttrain_allows = strategy_cls  # type: ignore[attr-defined]
    Fabric._validate_setup_optimizers = validate


# -- DeepSpeed on CPU ------------------------------------------------------------------------------------------------
SHM_OP = "ShareMemCommBuilder"


def skip_deepspeed_shm_op() -> None:
    """Let DeepSpeed's communication backend start on CPU without JIT-compiling its shared-memory all-reduce op.

    On CPU, DeepSpeed builds that op when its backend starts (``deepspeed.comm.torch.build_shm_op``: ~25 s of C++
    compiling on a machine's first run, and a compiler at all), yet only ``inference_all_reduce`` (DeepSpeed
    inference's tensor parallelism) calls it: ZeRO training reduces through torch.distributed either way. The op is
    marked unusable in DeepSpeed's own table of ops, the path DeepSpeed takes on machines that cannot build it."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__[get_accelerator().get_op_builder(SHM_OP).NAME] = False


def allow_fp16_on_deepspeed_cpu(device_type: str, precision: str) -> None:
    """DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has native fp16 kernels (AVX512-FP16/AMX). torch
    computes fp16 on any CPU, slowly, which is enough for what CPU runs are for: testing a set-up (loss scaling,
    overflow skips) before paying for GPUs. Only CPU runs in fp16 are affected."""
    if device_type == "cpu" and precision.startswith("16"):
        import torch
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        if not accelerator.is_fp16_supported():
            accelerator.is_fp16_supported = lambda: True
            accelerator.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]


# -- torch.distributed: the bytes torchrec's all-to-alls send -----------------------------------------------------
_ALL_TO_ALL_LISTENERS: Any = None  # a WeakSet of objects with add_all_to_all(input, input_split_sizes, group)


def count_all_to_all(listener: Any) -> None:
    """Call ``listener.add_all_to_all(input, input_split_sizes, group)`` before every
    ``torch.distributed.all_to_all_single`` of this process, as long as ``listener`` lives.

    torchrec sends ids, lengths, pooled embeddings and their gradients with ``dist.all_to_all_single`` (its module
    reads the function from ``torch.distributed`` at each call); torch offers no hook that sees those tensors on
    gloo (a work's completion hook is NCCL's alone). The function is wrapped once per process; the wrapper calls
    the live listeners and then torch's own function unchanged."""
    global _ALL_TO_ALL_LISTENERS
    import weakref

    import torch.distributed as dist

    if _ALL_TO_ALL_LISTENERS is None:
        _ALL_TO_ALL_LISTENERS = weakref.WeakSet()
        original = dist.all_to_all_single

        @functools.wraps(original)
        def all_to_all_single(output: Any, input: Any, output_split_sizes: Any = None, input_split_sizes: Any = None,
                              group: Any = None, async_op: bool = False) -> Any:
            for counter in list(_ALL_TO_ALL_LISTENERS):
                counter.add_all_to_all(input, input_split_sizes, group)
            return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_to_all_single = all_to_all_single
    _ALL_TO_ALL_LISTENERS.add(listener)


# -- torch.cuda: a machine without NVML -----------------------------------------------------------------------------
def remember_missing_nvml() -> None:
    """Remember, once per process, that the NVIDIA management library (``libnvidia-ml.so.1``) cannot be loaded.

    Lightning sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` when imported (so that a CUDA check does not initialise CUDA
    before its launcher forks). torch then counts devices through NVML at every ``torch.cuda.is_available()`` until
    CUDA is initialised, loading the library each time; on a machine without it (CPU machines with torch's CUDA
    build: CI, the tests of a set-up) each call is a failed library load of ~0.1 ms instead of ~1 us, and torch's
    fake tensors ask before every operation they dispatch (DTensor's sharding propagation, pipeline stage
    balancing), ~2% of a CPU process's time. After the first failure the same ``OSError`` is raised at once, which
    torch answers as it did (no NVML: ``cudaGetDeviceCount``); a machine whose library loads is not affected."""
    import torch.cuda

    original = torch.cuda._raw_device_count_nvml
    if getattr(original, "_disttrain_missing", None) is not None:
        return  # installed
    missing: list[tuple] = []  # the first failure's arguments, once there was one

    @functools.wraps(original)
    def raw_device_count_nvml() -> int:
        if missing:
            raise OSError(*missing[0])
        try:
            return original()
        except OSError as error:  # only loading the library raises it: it will not load later either
            missing.append(error.args)
            raise

    raw_device_count_nvml._disttrain_missing = missing  # type: ignore[attr-defined]
    torch.cuda._raw_device_count_nvml = raw_device_count_nvml
