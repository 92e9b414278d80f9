"""DeepSpeed's side of the ZeRO engine (:mod:`disttrain.parallel.engines.zero`): the options, the config built from
them and the Trainer/Fabric settings, the contexts around ``deepspeed.zero.Init`` (stage 3), the CPU-Adam swap, and
the optimizer attached after the model (torch and deepspeed only). Checkpoints:
:mod:`disttrain.parallel.checkpoint.zero`.

What each ZeRO stage keeps on a rank (N data-parallel ranks; DeepSpeed's own engine, ``zero_optimization.stage``):

=====  ====================================  ======================================================================
stage  strategy names                        per rank
=====  ====================================  ======================================================================
1      disttrain_zero1                       whole parameters and gradients; 1/N of the fp32 master weights and
                                             optimizer state (flat ranges of each parameter group)
2      disttrain_zero2, ..._zero2_offload    whole parameters; 1/N of the gradients, master weights and
                                             optimizer state (offload: those in host memory, ZeRO-Offload)
3      disttrain_zero3, ..._zero3_offload    1/N of everything (parameters gathered per submodule)
=====  ====================================  ======================================================================
"""

from __future__ import annotations

import copy
import ctypes
import json
import math
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

import torch

OFFLOAD_DEVICES = (None, "cpu", "nvme")
REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements), which our config keeps
# The registered name of each ZeRO stage (disttrain.parallel.registry), for errors that name the strategy to use.
STAGE_NAMES = {1: "disttrain_zero1", 2: "disttrain_zero2", 3: "disttrain_zero3"}


@dataclass
class ZeroOptions:
    """What a user can set on ``disttrain_zero1``, ``disttrain_zero2`` (``_offload``) and ``disttrain_zero3``
    (``_offload``) (Trainer and Fabric alike).

    stage: the ZeRO stage (each name sets its own): 1 partitions the optimizer state and fp32 master weights over the
        ranks, 2 the gradients too, 3 the parameters too (built under ``deepspeed.zero.Init``).
    offload_optimizer: None, "cpu" or "nvme": where optimizer state and fp32 master weights live ("nvme": stage 3).
    offload_parameters: None, "cpu" or "nvme": where parameters live between uses (stage 3).
    nvme_path: a folder on a fast local disk, for "nvme" offload.
    config: a DeepSpeed config (dict or JSON file) merged with ours; e.g. bucket sizes. A value that contradicts
        the Trainer/Fabric settings (batch sizes, accumulation, clipping, precision, stage) is an error.
    cpu_adam: use DeepSpeedCPUAdam for an offloaded optimizer (the user's Adam/AdamW hyper-parameters are kept).
        None = on GPU yes (fast), on CPU no (the torch optimizer runs on the CPU anyway, and DeepSpeedCPUAdam
        costs a ~2.5-minute JIT build the first time).
    extensions_dir: where DeepSpeed JIT-builds ops such as CPU Adam (TORCH_EXTENSIONS_DIR); reuse it to build once.
    micro_batch_size, gradient_accumulation_steps: Fabric only (the Trainer reads its DataLoader and
        ``accumulate_grad_batches``, and refuses these). Under Fabric, call ``optimizer.step()`` after every
        ``gradient_accumulation_steps`` calls of ``fabric.backward(loss)`` (DeepSpeed divides each loss by it).
    broadcast_buffers: keep buffers (BatchNorm running statistics) equal across the ranks: rank 0's after every
        training forward, as DDP's ``broadcast_buffers=True`` does; False lets each rank keep its own.
    sync_batchnorm: BatchNorm layers as SyncBatchNorm (GPU only, as under DDP); the Trainer's
        ``sync_batchnorm=True`` does the same.
    async_checkpoint: not offered here (refused): DCP's host-memory staging cannot copy the ShardedTensors that
        hold DeepSpeed's partitions; disttrain_fsdp (the same ZeRO-3 sharding) offers it.
    """

    stage: int = 3
    offload_optimizer: Optional[str] = None
    offload_parameters: Optional[str] = None
    nvme_path: str = "/local_nvme"
    config: Union[dict, str, None] = None
    cpu_adam: Optional[bool] = None
    extensions_dir: Optional[str] = None
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False
    async_checkpoint: bool = False

    # Options of other disttrain strategies that this one cannot serve (parallel.options.build_options).
    refused: ClassVar[dict[str, str]] = {
        "compile": "DeepSpeed's engine runs its own hooks inside the blocks torch.compile would trace (ZeRO-3 gathers"
                   " and frees each layer's parameters there); use disttrain_fsdp (ZeRO-3's sharding) or"
                   " disttrain_ddp with compile=True",
        "gradient_compression": "DeepSpeed compresses its own gradient traffic: pass it in the DeepSpeed config, e.g."
                                " config={'communication_data_type': 'bf16'}, or use disttrain_fsdp's"
                                " gradient_compression",
    }

    def __post_init__(self) -> None:
        if self.stage not in STAGE_NAMES or isinstance(self.stage, bool):
            raise ValueError(f"stage={self.stage!r} is not a ZeRO stage disttrain runs; choose 1, 2 or 3"
                             f" ({', '.join(STAGE_NAMES.values())}; stage 0 is disttrain_ddp)")
        if self.async_checkpoint:
            raise ValueError(f"async_checkpoint=True is not offered on {self.name}: its checkpoints hold DeepSpeed's"
                             " partitions as ShardedTensors, which DCP's host-memory staging (DefaultStager) cannot"
                             " copy; use disttrain_fsdp (ZeRO-3's sharding) or disttrain_ddp for async checkpoints,"
                             " or remove async_checkpoint")
        if self.stage < 3:  # what only ZeRO-3 does
            if self.offload_parameters is not None:
                raise ValueError(f"offload_parameters={self.offload_parameters!r} is ZeRO stage 3 only ({self.name}"
                                 " keeps the parameters whole on every rank); use disttrain_zero3_offload, or remove"
                                 " offload_parameters")
            if self.offload_optimizer == "nvme":
                raise ValueError(f"offload_optimizer='nvme' is ZeRO stage 3 only; {STAGE_NAMES[self.stage]} offloads"
                                 " the optimizer to 'cpu' (offload_optimizer='cpu'), or use disttrain_zero3_offload"
                                 " with offload_optimizer='nvme' for NVMe")
        for name in ("offload_optimizer", "offload_parameters"):
            if getattr(self, name) not in OFFLOAD_DEVICES or isinstance(getattr(self, name), bool):
                said = " (Lightning's True is 'cpu' here)" if getattr(self, name) is True else ""
                raise ValueError(f"{name}={getattr(self, name)!r} is not a place to offload to; choose None, 'cpu'"
                                 f" or 'nvme'{said}")
        if "nvme" in (self.offload_optimizer, self.offload_parameters) and not Path(self.nvme_path).is_dir():
            raise ValueError(f"nvme_path={self.nvme_path!r} is not a folder; pass nvme_path= a folder on a local"
                             " NVMe disk for nvme offload")
        for name in ("micro_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.nvme_path != "/local_nvme" and "nvme" not in (self.offload_optimizer, self.offload_parameters):
            raise ValueError(f"nvme_path={self.nvme_path!r} applies to NVMe offload; pass offload_optimizer='nvme'"
                             " and/or offload_parameters='nvme' with it, or remove nvme_path")
        if self.cpu_adam is not None and self.offload_optimizer is None:
            raise ValueError(f"cpu_adam={self.cpu_adam} applies to an offloaded optimizer; set"
                             " offload_optimizer='cpu' (the _offload names do), or remove cpu_adam")

    @property
    def name(self) -> str:
        """The registered strategy name of these options' stage (and offload), for messages."""
        offload = "_offload" if self.offload_optimizer and self.stage in (2, 3) else ""
        return STAGE_NAMES.get(self.stage, "disttrain_zero3") + offload

    def use_cpu_adam(self, device_type: str) -> bool:
        if self.offload_optimizer is None:
            return False
        return self.cpu_adam if self.cpu_adam is not None else device_type == "cuda"


def load_user_config(config: Union[dict, str, os.PathLike, None]) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config {str(path)!r} does not exist; pass a JSON file or a dict")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"DeepSpeed config {str(path)!r} is not valid JSON: {e}") from e


def _offload(device: Optional[str], nvme_path: str, pin: bool) -> dict:
    entry: dict[str, Any] = {"device": device, "pin_memory": pin}
    if device == "nvme":
        entry["nvme_path"] = nvme_path
    return entry


def zero_config(
    options: ZeroOptions,
    *,
    precision: str,
    micro_batch_size: int,
    accumulation: int,
    world_size: int,
    gradient_clipping: Optional[float],
    device_type: str,
) -> dict:
    """The full DeepSpeed config for ``options.stage``. Batch settings always agree: train_batch_size = micro x
    accumulation x world (the assertion Lightning users hit when a config sets only some of them)."""
    owned: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro_batch_size * accumulation * world_size,
    }
    if gradient_clipping:
        owned["gradient_clipping"] = float(gradient_clipping)
    if options.stage == 3:
        zero: dict[str, Any] = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}
    else:
        zero = {"stage": options.stage, **stage12_defaults()}
    pin = device_type == "cuda"  # pinned host memory needs the CUDA driver
    if options.offload_optimizer:
        zero["offload_optimizer"] = _offload(options.offload_optimizer, options.nvme_path, pin)
    if options.offload_parameters:
        zero["offload_param"] = _offload(options.offload_parameters, options.nvme_path, pin)
    # DeepSpeed clips gradients at norm 1.0 when the key is absent: say 0.0 (no clipping) unless asked for.
    ours: dict[str, Any] = {"zero_optimization": zero, "zero_allow_untested_optimizer": True,
                            "gradient_clipping": 0.0, **owned}
    if options.offload_optimizer and not options.use_cpu_adam(device_type):
        ours["zero_force_ds_cpu_optimizer"] = False  # ZeRO-Offload refuses a client torch optimizer otherwise
    if precision in ("16-mixed", "16-true"):
        ours["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                        "hysteresis": 2, "min_loss_scale": 1}  # loss_scale 0 = dynamic
    elif precision in ("bf16-mixed", "bf16-true"):
        ours["bf16"] = {"enabled": True}

    user = load_user_config(options.config)
    _check_conflicts(user, owned, precision, options)
    return _merge(ours, user)


zero3_config = zero_config  # the name of the stage-3-only builder (bench/, the planner's calibration)

# ZeRO-1/2's bucket options, as DeepSpeed defaults them (written out so that the config shows what runs).
STAGE12_KEYS = ("contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
                "allgather_bucket_size")


def stage12_defaults() -> dict[str, Any]:
    """DeepSpeed's own defaults of :data:`STAGE12_KEYS` for stage 1/2 (``overlap_comm``: off below stage 3)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = DeepSpeedZeroConfig.model_fields
    defaults = {key: fields[key].default for key in STAGE12_KEYS}
    defaults["overlap_comm"] = False  # its None means "stage 3 only"
    return {key: value if isinstance(value, bool) else int(value) for key, value in defaults.items()}


def _check_conflicts(user: dict, owned: dict, precision: str, options: ZeroOptions) -> None:
    for key, value in owned.items():
        if key in user and user[key] != value:
            source = {"train_micro_batch_size_per_gpu": "the DataLoader's batch_size (Fabric: micro_batch_size=)",
                      "gradient_accumulation_steps": "accumulate_grad_batches (Fabric: gradient_accumulation_steps=)",
                      "train_batch_size": "micro batch x accumulation x world size",
                      "gradient_clipping": "gradient_clip_val"}[key]
            raise ValueError(f"ds_config sets {key}={user[key]!r} but {source} gives {value!r}; remove {key} from"
                             " the ds_config (disttrain sets it) or change the Trainer/Fabric setting")
    stage = user.get("zero_optimization", {}).get("stage", options.stage)
    if stage != options.stage:
        use = STAGE_NAMES.get(stage, "disttrain_ddp" if stage == 0 else None)
        instead = f"use {use} (strategy={use!r}) for stage {stage}, or " if use else ""
        raise ValueError(f"ds_config sets zero_optimization.stage={stage!r} but {options.name} is ZeRO stage"
                         f" {options.stage}; {instead}remove the stage from the ds_config")
    half = "fp16" if precision.startswith("16") else "bf16" if precision.startswith("bf16") else None
    for key in ("fp16", "bf16"):
        if user.get(key, {}).get("enabled") and key != half:
            raise ValueError(f"ds_config enables {key} but the precision is {precision!r}; set"
                             f" precision={'16-mixed' if key == 'fp16' else 'bf16-mixed'!r} instead of {key} in"
                             " the ds_config")


def _merge(ours: dict, user: dict) -> dict:
    """The user's keys refine ours (nested dicts merged); conflicts on owned keys were rejected before."""
    merged = copy.deepcopy(ours)
    for key, value in user.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def set_extensions_dir(options: ZeroOptions) -> None:
    """Point DeepSpeed's JIT op builds (CPU Adam) at a reusable cache folder before anything is built."""
    if options.extensions_dir:
        Path(options.extensions_dir).mkdir(parents=True, exist_ok=True)
        os.environ["TORCH_EXTENSIONS_DIR"] = str(options.extensions_dir)


def _zero_padding_rows(model: torch.nn.Module) -> None:
    """Each embedding's padding row zero, as one process has it: under ZeRO-3 transformers initialises a head tied
    to the embedding after the embedding, over its padding row."""
    import deepspeed

    for sub in model.modules():
        if isinstance(sub, torch.nn.Embedding) and sub.padding_idx is not None:
            with deepspeed.zero.GatheredParameters([sub.weight], modifier_rank=0):
                if torch.distributed.get_rank() == 0:
                    with torch.no_grad():
                        sub.weight[sub.padding_idx].zero_()


def release_freed_memory() -> None:
    """Hand memory the process freed back to the system (glibc ``malloc_trim``; elsewhere a no-op)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def import_dynamo_before_zero_init() -> None:
    """Import ``torch._dynamo`` before ``deepspeed.zero.Init`` is entered (a no-op once imported).

    Why: zero.Init replaces ``torch.Tensor.__new__`` while it is open, and torch._dynamo, on its first import, checks
    that its polyfill of ``torch.Tensor.__new__`` has the signature of the one in place. A first import inside
    zero.Init (a model that imports transformers -> torchvision -> torch._dynamo lazily, or calls torch.compile)
    fails with ``TypeError: Signature mismatch between <function get_new_tensor_fn_for_dtype.<locals>.new_tensor>
    and <function tensor_pynew>``. Lightning imports it first only where torchvision is installed."""
    import torch._dynamo  # noqa: F401


@contextmanager
def keep_decorated_inits() -> Iterator[None]:
    """Around ``deepspeed.zero.Init``: a module class first defined while it is open (a model's module imported lazily
    in ``configure_model``) keeps the ``__init__`` its class decorators gave it once the context closes.

    Why: zero.Init wraps the ``__init__`` of each class created while it is open (``Module.__init_subclass__``) and on
    exit puts back the one it saw then, before any class decorator ran. transformers' kernel decorator
    (``use_kernelized_func``, on the attention of Llama-family models since transformers 5.25) replaces ``__init__``
    after that, so DeepSpeed's restore drops it and every instance built later lacks ``_kernel_funcs``
    (AttributeError in forward). Here each such decorated ``__init__`` is kept, with the zero.Init wrapper it captured
    replaced by the function that wrapper wraps."""
    from deepspeed.runtime.zero.partition_parameters import Init

    before = set(_module_classes())
    original = Init.unpatch_init_and_builtins
    decorated: dict[type, Any] = {}

    def unpatch(self: Any) -> None:
        for cls in set(_module_classes()) - before:
            init, raw = cls.__dict__.get("__init__"), getattr(cls, "_old_init", None)
            if raw is not None and init is not None and getattr(init, "__wrapped__", None) is not raw:
                decorated[cls] = init  # something replaced zero.Init's wrapper after the class was created
        original(self)

    Init.unpatch_init_and_builtins = unpatch  # type: ignore[method-assign]
    try:
        yield
    finally:
        Init.unpatch_init_and_builtins = original  # type: ignore[method-assign]
        for cls, init in decorated.items():
            unwrapped = _without_zero_init(init, cls._old_init)
            if unwrapped is not None:
                cls.__init__ = unwrapped


def _module_classes() -> Iterator[type]:
    todo = [torch.nn.Module]
    while todo:
        cls = todo.pop()
        yield cls
        todo += cls.__subclasses__()


def _without_zero_init(init: Any, raw: Any) -> Any:
    """A copy of the decorated ``init`` whose closure holds ``raw`` where it held zero.Init's wrapper of ``raw``
    (None when it holds no such wrapper: the decorator is of another shape, and DeepSpeed's restore stands)."""
    import types

    cells = init.__closure__ or ()
    found = [i for i, cell in enumerate(cells) if getattr(cell.cell_contents, "__wrapped__", None) is raw]
    if not found:
        return None
    closure = tuple(types.CellType(raw) if i in found else cell for i, cell in enumerate(cells))
    copy_ = types.FunctionType(init.__code__, init.__globals__, init.__name__, init.__defaults__, closure)
    copy_.__kwdefaults__, copy_.__qualname__, copy_.__doc__ = init.__kwdefaults__, init.__qualname__, init.__doc__
    return copy_


@contextmanager
def trim_while_partitioning(min_bytes: int = 8 * 2**20) -> Iterator[None]:
    """Around ``deepspeed.zero.Init``: after each module with at least ``min_bytes`` of its own parameters is
    partitioned, the whole tensors it was built with (just freed) go back to the system.

    Why: zero.Init builds every module whole, then keeps only this rank's partition. glibc keeps the freed blocks of a
    big model's construction in its heap (its mmap threshold grows with the first frees), so without this the process
    ends construction holding about the whole model on a 1B model at 2 processes, where it needs its share."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._post_init_method

    def post_init(self: Any, module: torch.nn.Module) -> None:
        original(self, module)
        own = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in module.parameters(recurse=False))
        if own >= min_bytes:
            release_freed_memory()

    Init._post_init_method = post_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        Init._post_init_method = original  # type: ignore[method-assign]
        release_freed_memory()


def weights_left_uninitialised() -> bool:
    """Whether modules built now get no initial values: inside transformers' ``no_init_weights()``, which makes
    torch's init functions no-ops because a load will fill every weight (anything else, transformers' own guarded
    init functions included, initialises)."""
    init = torch.nn.init.normal_
    return (getattr(init, "__name__", "") == "empty_func"
            and getattr(init, "__module__", "") == "transformers.initialization")


@contextmanager
def no_broadcast_of_uninitialised_weights() -> Iterator[None]:
    """Around ``deepspeed.zero.Init``: a parameter built while the weights are left uninitialised
    (:func:`weights_left_uninitialised`) is partitioned without first being broadcast whole from rank 0.

    Why: zero.Init broadcasts every new parameter from rank 0 so that all ranks partition the same initial values.
    When a load replaces them all, that sends the whole model over the network for nothing and writes each whole
    tensor on every other rank (its pages touched: a 1B model's 250 MiB embedding above the share at set-up)."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._zero_init_param

    def init_param(self: Any, param: Any) -> None:
        if not weights_left_uninitialised():
            return original(self, param)
        self._convert_to_deepspeed_param(param)
        param.partition()

    Init._zero_init_param = init_param  # type: ignore[method-assign]
    try:
        yield
    finally:
        Init._zero_init_param = original  # type: ignore[method-assign]


@contextmanager
def hf_init_after_partitioning() -> Iterator[None]:
    """Around ``deepspeed.zero.Init``: Hugging Face models built inside get their weights initialised the way
    transformers does under its own ZeRO-3 integration, once the model is complete (each module's parameters gathered
    in turn, initialised by ``_init_weights`` on rank 0, broadcast; then the tied weights tied).

    Needed because zero.Init partitions each module as its constructor returns, so the ``post_init`` of the whole
    model would initialise empty partitions: a no-op, except for an embedding's ``padding_idx`` row, whose indexing
    fails (``IndexError: index 0 is out of bounds``) for every config with a ``pad_token_id`` (Phi-3, Mistral, ...).
    transformers only takes its own zero3 path when it holds the DeepSpeed config (``HfDeepSpeedConfig``), which
    the strategy keeps to itself."""
    try:
        from transformers import PreTrainedModel
        from transformers.integrations.deepspeed import initialize_weights_zero3
    except ImportError:  # no transformers: nothing to defer
        yield
        return
    built: list[PreTrainedModel] = []
    original = PreTrainedModel.initialize_weights

    def defer(model: PreTrainedModel) -> None:
        built.append(model)

    PreTrainedModel.initialize_weights = defer  # type: ignore[method-assign]
    try:
        yield
    finally:
        PreTrainedModel.initialize_weights = original  # type: ignore[method-assign]
    inner = {id(sub) for model in built for sub in model.modules() if sub is not model}
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    gathered_exit = GatheredParameters.__exit__

    def exit_and_trim(self: Any, *exc: Any) -> Any:  # each module is gathered whole, then freed: give it back
        result = gathered_exit(self, *exc)
        release_freed_memory()
        return result

    GatheredParameters.__exit__ = exit_and_trim  # type: ignore[method-assign]
    try:
        for model in built:
            if id(model) not in inner:  # a model's sub-models are initialised with it
                initialize_weights_zero3(model)
                model.tie_weights()
                _zero_padding_rows(model)
    finally:
        GatheredParameters.__exit__ = gathered_exit  # type: ignore[method-assign]


def to_cpu_adam(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same Adam/AdamW (groups and hyper-parameters) as DeepSpeedCPUAdam, the fast optimizer for an
    offloaded optimizer state. Other optimizers are returned unchanged."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return optimizer
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    groups = [{k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
              for g in optimizer.param_groups]
    return DeepSpeedCPUAdam(groups, adamw_mode=isinstance(optimizer, torch.optim.AdamW))


def partition_elements(numels: Iterable[int], world_size: int) -> int:
    """Elements of ZeRO-3's partition on every rank for parameters of these sizes: DeepSpeed pads each parameter to a
    multiple of the world size (``partition_parameters``' ``_padding_size``) and keeps ``ceil(numel / n)`` each."""
    return sum(math.ceil(numel / world_size) for numel in numels)


def zero_partition_numel(module: torch.nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model) for a model partitioned by zero.Init."""
    local = total = 0
    for p in module.parameters():
        if hasattr(p, "ds_tensor"):
            local += p.ds_tensor.numel()
            total += p.ds_numel
        else:
            local += p.numel()
            total += p.numel()
    return local, total


@contextmanager
def optimizer_later() -> Iterator[None]:
    """Around ``deepspeed.initialize(model=...)`` without an optimizer: a stage 1/2 engine is made without its ZeRO
    optimizer (``engine.optimizer`` None), for :func:`attach_zero_optimizer` to add. DeepSpeed itself refuses it
    ("zero stage 2 requires an optimizer"): its stage 1/2 optimizer flattens the parameters of the optimizer's groups,
    which do not exist yet (Fabric's ``setup_module`` then ``setup_optimizers``)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._configure_zero_optimizer

    def later(engine: Any, optimizer: Any) -> Any:
        if optimizer is None and engine.zero_optimization_stage() < 3:
            return None
        return original(engine, optimizer)

    DeepSpeedEngine._configure_zero_optimizer = later  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeepSpeedEngine._configure_zero_optimizer = original  # type: ignore[method-assign]


def attach_zero_optimizer(engine: Any, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None) -> Any:
    """Give an engine made without an optimizer (``deepspeed.initialize(model=...)``; stage 1/2 under
    :func:`optimizer_later`, stage 3 with its parameters partitioned and the module hooked for forward only) its ZeRO
    optimizer over the model's parameters, as ``deepspeed.initialize(model=, optimizer=)`` would have made it; the
    engine stays the same object. Returns the ZeRO optimizer.

    DeepSpeed has no public call for this; these are the steps its engine constructor takes when it is given an
    optimizer (``_configure_optimizer`` builds the ZeRO optimizer, which hooks the module itself), after ZeRO-3's
    forward-only hooks are removed and every parameter is back in its partition."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.utils import check_internal_apis_for_count_used_parameters
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    forward_only = engine.optimizer
    if isinstance(forward_only, DeepSpeedZeRoOffload):
        forward_only.partition_all_parameters()
        forward_only.destroy()
    elif forward_only is not None:
        raise RuntimeError(f"the DeepSpeed engine already has an optimizer ({type(forward_only).__name__}); DeepSpeed"
                           " trains one optimizer per model: set up one optimizer for it")
    engine.client_optimizer, engine.client_lr_scheduler = optimizer, lr_scheduler
    engine._configure_optimizer(optimizer, [p for p in engine.module.parameters() if p.requires_grad])
    engine._configure_lr_scheduler()
    engine._configure_checkpointing()
    if isinstance(engine.optimizer, ZeROOptimizer) and check_internal_apis_for_count_used_parameters():
        engine._support_torch_style_backward = True
        engine.optimizer.register_grad_acc_post_hook(engine._backward_post_hook)
    return engine.optimizer


def zero_stage_of(optimizer: Any) -> Optional[int]:
    """The ZeRO stage of DeepSpeed's ZeRO optimizer ``optimizer`` (3, or 1/2 for the stage 1/2 optimizer, which
    partitions gradients at 2), else None."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        return 3
    if hasattr(optimizer, "single_partition_of_fp32_groups"):
        return 2 if optimizer.partition_gradients else 1
    return None


def zero_grad_norm(zero_optimizer: Any) -> torch.Tensor:
    """The 2-norm of the whole model's gradients (every rank's partitions, unscaled by the fp16 loss scale), computed
    as DeepSpeed computes it when it clips in ``step()``; inf when a gradient is not finite. Collective."""
    from deepspeed.runtime.utils import combine_grad_norm_groups

    if zero_stage_of(zero_optimizer) == 3:
        scaled = combine_grad_norm_groups(zero_optimizer._get_norm_groups())
    else:
        scaled = zero_optimizer.scaled_global_norm()
    return scaled / zero_optimizer.loss_scale
