"""DeepSpeed ZeRO-3: the config built from our options and the Trainer/Fabric settings, the CPU-Adam swap,
and consolidation of ZeRO checkpoints. Used by both ZeRO adapters (torch and deepspeed only)."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from disttrain.parallel.checkpoint import flatten_optimizer, restore_rest, unflatten_optimizer

OFFLOAD_DEVICES = (None, "cpu", "nvme")


@dataclass
class ZeroOptions:
    """What a user can set on ``disttrain_zero3`` / ``disttrain_zero3_offload`` (Trainer and Fabric alike).

    offload_optimizer: None, "cpu" or "nvme": where optimizer state and fp32 master weights live.
    offload_parameters: None, "cpu" or "nvme": where parameters live between uses.
    nvme_path: a folder on a fast local disk, for "nvme" offload.
    config: a DeepSpeed config (dict or JSON file) merged with ours; e.g. bucket sizes. A value that contradicts
        the Trainer/Fabric settings (batch sizes, accumulation, clipping, precision, stage) is an error.
    cpu_adam: use DeepSpeedCPUAdam for an offloaded optimizer (the user's Adam/AdamW hyper-parameters are kept).
        None = on GPU yes (fast), on CPU no (the torch optimizer runs on the CPU anyway, and DeepSpeedCPUAdam
        costs a ~2.5-minute JIT build the first time).
    extensions_dir: where DeepSpeed JIT-builds ops such as CPU Adam (TORCH_EXTENSIONS_DIR); reuse it to build once.
    micro_batch_size, gradient_accumulation_steps: Fabric only (the Trainer reads its DataLoader and
        ``accumulate_grad_batches``).
    broadcast_buffers: keep buffers (BatchNorm running statistics) equal across the ranks: rank 0's after every
        training forward, as DDP's ``broadcast_buffers=True`` does; False lets each rank keep its own.
    sync_batchnorm: BatchNorm layers as SyncBatchNorm (GPU only, as under DDP); the Trainer's
        ``sync_batchnorm=True`` does the same.
    """

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

    def __post_init__(self) -> None:
        for name in ("offload_optimizer", "offload_parameters"):
            if getattr(self, name) not in OFFLOAD_DEVICES:
                raise ValueError(f"{name}={getattr(self, name)!r} is not a place to offload to; choose None, 'cpu'"
                                 " or 'nvme'")
        if "nvme" in (self.offload_optimizer, self.offload_parameters) and not Path(self.nvme_path).is_dir():
            raise ValueError(f"nvme_path={self.nvme_path!r} is not a folder; pass nvme_path= a folder on a local"
                             " NVMe disk for nvme offload")
        for name in ("micro_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")

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


def zero3_config(
    options: ZeroOptions,
    *,
    precision: str,
    micro_batch_size: int,
    accumulation: int,
    world_size: int,
    gradient_clipping: Optional[float],
    device_type: str,
) -> dict:
    """The full DeepSpeed config. Batch settings always agree: train_batch_size = micro x accumulation x world
    (the assertion Lightning users hit when a config sets only some of them)."""
    owned: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro_batch_size * accumulation * world_size,
    }
    if gradient_clipping:
        owned["gradient_clipping"] = float(gradient_clipping)
    zero: dict[str, Any] = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}
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
    _check_conflicts(user, owned, precision)
    return _merge(ours, user)


def _check_conflicts(user: dict, owned: dict, precision: str) -> None:
    for key, value in owned.items():
        if key in user and user[key] != value:
            source = {"train_micro_batch_size_per_gpu": "the DataLoader's batch_size (Fabric: micro_batch_size=)",
                      "gradient_accumulation_steps": "accumulate_grad_batches (Fabric: gradient_accumulation_steps=)",
                      "train_batch_size": "micro batch x accumulation x world size",
                      "gradient_clipping": "gradient_clip_val"}[key]
            raise ValueError(f"ds_config sets {key}={user[key]!r} but {source} gives {value!r}; remove {key} from"
                             " the ds_config (disttrain sets it) or change the Trainer/Fabric setting")
    stage = user.get("zero_optimization", {}).get("stage", 3)
    if stage != 3:
        raise ValueError(f"ds_config sets zero_optimization.stage={stage} but disttrain_zero3 is ZeRO stage 3;"
                         " remove the stage from the ds_config")
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


def to_cpu_adam(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same Adam/AdamW (groups and hyper-parameters) as DeepSpeedCPUAdam, the fast optimizer for an
    offloaded optimizer state. Other optimizers are returned unchanged."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return optimizer
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    groups = [{k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
              for g in optimizer.param_groups]
    return DeepSpeedCPUAdam(groups, adamw_mode=isinstance(optimizer, torch.optim.AdamW))


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


def attach_zero3_optimizer(engine: Any, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None) -> Any:
    """Give an engine made without an optimizer (``deepspeed.initialize(model=...)``: ZeRO-3 partitioned the
    parameters and hooked the module for forward only) its ZeRO-3 optimizer over those partitioned parameters, as
    ``deepspeed.initialize(model=, optimizer=)`` would have made it; the engine stays the same object. Returns the
    ZeRO-3 optimizer.

    DeepSpeed has no public call for this; these are the steps its engine constructor takes when it is given an
    optimizer (``_configure_optimizer`` builds the ZeRO-3 optimizer, which hooks the module itself), after the
    forward-only hooks are removed and every parameter is back in its partition."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.utils import check_internal_apis_for_count_used_parameters
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    forward_only = engine.optimizer
    if not isinstance(forward_only, DeepSpeedZeRoOffload):
        raise RuntimeError(f"the DeepSpeed engine already has an optimizer ({type(forward_only).__name__}); DeepSpeed"
                           " trains one optimizer per model: set up one optimizer for it")
    forward_only.partition_all_parameters()
    forward_only.destroy()
    engine.client_optimizer, engine.client_lr_scheduler = optimizer, lr_scheduler
    engine._configure_optimizer(optimizer, [p for p in engine.module.parameters() if p.requires_grad])
    engine._configure_lr_scheduler()
    engine._configure_checkpointing()
    if isinstance(engine.optimizer, ZeROOptimizer) and check_internal_apis_for_count_used_parameters():
        engine._support_torch_style_backward = True
        engine.optimizer.register_grad_acc_post_hook(engine._backward_post_hook)
    return engine.optimizer


def zero3_grad_norm(zero_optimizer: Any) -> torch.Tensor:
    """The 2-norm of the whole model's gradients (every rank's partitions, unscaled by the fp16 loss scale), computed
    as DeepSpeed computes it when it clips in ``step()``; inf when a gradient is not finite. Collective."""
    from deepspeed.runtime.utils import combine_grad_norm_groups

    return combine_grad_norm_groups(zero_optimizer._get_norm_groups()) / zero_optimizer.loss_scale


def is_zero_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / "latest").is_file()


def zero_fp32_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a ZeRO checkpoint folder, merged from every rank's shards (DeepSpeed's
    zero_to_fp32; it unpickles DeepSpeed's own checkpoint files, so load only checkpoints you wrote)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(path))


def export_zero3(module: torch.nn.Module, path: Union[str, os.PathLike], prefix: str = "") -> Path:
    """Gather a ZeRO-3 partitioned module on every rank and write its full state dict from rank 0 as safetensors.
    Collective: call on every rank."""
    import deepspeed

    from disttrain.parallel.checkpoint import _rank, write_from_rank0

    state: dict[str, torch.Tensor] = {}
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        if _rank() == 0:
            state = {k: v.detach().to("cpu").clone() for k, v in module.state_dict().items()}
    return write_from_rank0(state, path, prefix)


# -- the one checkpoint layout (DCP, parameters by fully qualified name) -----------------------------------------
# Why this way: a DeepSpeed folder holds flat per-rank fp32 partitions whose boundaries depend on the world size
# and on DeepSpeed's sub-groups, so nothing else can read it. Here every parameter is gathered one at a time
# (DeepSpeed's safe_get_full_* API, a collective) and written under its FQN, exactly as FSDP/Megatron/DDP write
# theirs (torch.distributed.checkpoint state dicts from get_model_state_dict / get_optimizer_state_dict). Rank 0
# holds the gathered tensors and writes them; the cost is one full copy of model + optimizer state in rank 0's
# host memory while saving, which is what zero_to_fp32 costs too. Loading reads each full tensor on every rank and
# keeps only this rank's partition (safe_set_full_*), so a checkpoint from any strategy and world size loads.

def _zero_optimizer(optimizer: Any) -> Any:
    if not hasattr(optimizer, "fp32_partitioned_groups_flat"):
        raise TypeError(f"{type(optimizer).__name__} is not DeepSpeed's ZeRO-3 optimizer; pass the optimizer that"
                        " fabric.setup returned for the disttrain_zero3 model")
    return optimizer


def _flat_state(zero_opt: Any, group: int) -> dict[str, Any]:
    return zero_opt.optimizer.state.get(zero_opt.fp32_partitioned_groups_flat[group], {})


def zero3_model_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 weights (the master copy) and persistent buffers by FQN, on rank 0 (empty elsewhere).
    Collective: call on every rank."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    params = dict(module.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        param = params.get(name)
        if param is None:  # a buffer: not partitioned
            value = tensor.detach()
        elif param.requires_grad and getattr(param, "_z3_optimizer", None) is not None:
            value = safe_get_full_fp32_param(param)
        else:  # frozen, or no optimizer yet: the (low-precision) weights themselves
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                value = param.detach().clone()
        if rank0:
            state[name] = value.to("cpu", copy=True)
    return state


def zero3_optimizer_state(module: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer state by FQN in the flattened form every disttrain checkpoint stores
    (``checkpoint.flatten_optimizer``: ``"state.<fqn>.exp_avg"``, ``"param_groups.<fqn>.lr"``), on rank 0 (``{}``
    elsewhere). Collective."""
    from deepspeed.utils import safe_get_full_optimizer_state

    zero_opt = _zero_optimizer(optimizer)
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    names = {id(p): n for n, p in module.named_parameters()}
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for i, params in enumerate(zero_opt.fp16_groups):
        flat = _flat_state(zero_opt, i)
        hyper = {k: v for k, v in zero_opt.optimizer.param_groups[i].items() if k != "params"}
        fqns = [names[id(p)] for p in params]
        same = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == hyper), None)
        if same is None:  # DeepSpeed splits one torch group into sub-groups: merge them back
            groups.append({**hyper, "params": fqns})
        else:
            same["params"].extend(fqns)
        for param, fqn in zip(params, fqns):
            entry: dict[str, Any] = {}
            for key, value in flat.items():
                if torch.is_tensor(value) and value.numel() == zero_opt.fp32_partitioned_groups_flat[i].numel():
                    full = safe_get_full_optimizer_state(param, key)  # collective
                    if full is not None:
                        entry[key] = full.reshape(param.ds_shape).to("cpu", copy=True)
                else:  # scalars shared by the flat group ("step")
                    entry[key] = value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
            if entry:
                state[fqn] = entry
    return flatten_optimizer({"state": state, "param_groups": groups}) if rank0 else {}  # the one stored form


@torch.no_grad()
def load_zero3_state(module: torch.nn.Module, optimizer: Any, model_state: dict[str, torch.Tensor],
                     optim_state: Optional[dict[str, Any]]) -> None:
    """Put full tensors by FQN (read from a checkpoint of any strategy) into a ZeRO-3 model and optimizer: every
    rank keeps its own partition. ``optim_state=None`` leaves the optimizer as it is. Collective."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    for name, value in model_state.items():
        if name in params:
            param = params[name]
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                param.data.copy_(value.to(param.dtype).reshape(param.shape))
            if optimizer is not None and param.requires_grad:
                safe_set_full_fp32_param(param, value.to(torch.float32).reshape(param.ds_shape))
        elif name in buffers:
            buffers[name].copy_(value)
    if optimizer is None or optim_state is None:
        return
    zero_opt = _zero_optimizer(optimizer)
    optim_state = unflatten_optimizer(optim_state)
    saved = optim_state["state"]
    for i, group_params in enumerate(zero_opt.fp16_groups):
        fp32_flat = zero_opt.fp32_partitioned_groups_flat[i]
        # torch optimizers create their state at the first step: before it, make room for the saved moments.
        flat = zero_opt.optimizer.state[fp32_flat]
        names = [n for p in group_params for n, q in params.items() if q is p]
        for param, fqn in zip(group_params, names):
            for key, value in saved.get(fqn, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:  # a moment, one value per element
                    if key not in flat:
                        flat[key] = torch.zeros_like(fp32_flat)
                    safe_set_full_optimizer_state(param, value.to(torch.float32).reshape(param.ds_shape), key)
                else:  # a scalar shared by the flat group ("step")
                    flat[key] = value.clone() if torch.is_tensor(value) else value
        group = zero_opt.optimizer.param_groups[i]
        for saved_group in optim_state["param_groups"]:
            if names and names[0] in saved_group["params"]:
                group.update({k: v for k, v in saved_group.items() if k != "params"})
    # The low-precision partitions the model computes with follow the fp32 master partitions.
    for i in range(len(zero_opt.fp16_groups)):
        zero_opt._reassign_or_swap_out_partitioned_parameters(i)


def _split_zero_state(state: dict[str, Any]) -> tuple[Optional[tuple[str, torch.nn.Module]], Optional[tuple[str, Any]],
                                                       dict[str, Any]]:
    model = optimizer = None
    rest: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            if model is not None:
                raise ValueError(f"checkpoint state must hold exactly one model, found {model[0]!r} and {key!r}")
            model = (key, value)
        elif hasattr(value, "fp32_partitioned_groups_flat") or isinstance(value, torch.optim.Optimizer):
            optimizer = (key, value)
        else:
            rest[key] = value
    return model, optimizer, rest


def save_zero3_checkpoint(path: Union[str, os.PathLike], state: dict[str, Any]) -> Path:
    """Fabric-style ``{"model": engine, "optimizer": opt, "step": 3}`` -> one DCP checkpoint folder in the layout
    every disttrain strategy reads (written atomically). Collective."""
    from disttrain.parallel.checkpoint import save_sharded

    model, optimizer, rest = _split_zero_state(state)
    if model is None:
        raise ValueError(f"checkpoint state must hold the model; it holds {sorted(state)}")
    module = getattr(model[1], "module", model[1])  # DeepSpeedEngine -> the user's model
    tensors: dict[str, Any] = {model[0]: zero3_model_state(module)}
    if optimizer is not None:
        tensors[optimizer[0]] = zero3_optimizer_state(module, optimizer[1])
    metadata = {k: v.state_dict() if callable(getattr(v, "state_dict", None)) else v for k, v in rest.items()}
    return save_sharded(path, tensors, metadata)


def load_zero3_checkpoint(path: Union[str, os.PathLike], state: dict[str, Any], strict: bool = True,
                          weights_only: bool = True) -> dict[str, Any]:
    """Restore a ZeRO-3 model/optimizer (and stateful objects of ``state``) from a disttrain DCP checkpoint of any
    strategy and world size; returns the metadata ``state`` did not ask for. Collective."""
    from disttrain.parallel.checkpoint import CheckpointError, check_checkpoint, read_full, read_meta

    model, optimizer, rest = _split_zero_state(state)
    if model is None:
        raise ValueError("load_checkpoint needs state={'model': model, ...} naming at least the model to restore")
    path = check_checkpoint(path)
    metadata = read_meta(path, weights_only)
    keys = {model[0]} | ({optimizer[0]} if optimizer else set())
    full = read_full(path, keys=keys)
    for key in sorted(keys):
        if key not in full:
            raise CheckpointError(f"checkpoint {str(path)!r} has no {key!r} (it holds {sorted(full)}); pass the"
                                  " same state keys that were saved")
    module = getattr(model[1], "module", model[1])
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(full[model[0]])), sorted(set(full[model[0]]) - expected)
    if strict and (missing or unexpected):
        raise CheckpointError(f"checkpoint {str(path)!r} does not match the model: missing {missing[:5]},"
                              f" unexpected {unexpected[:5]}; pass strict=False to load the common keys")
    load_zero3_state(module, optimizer[1] if optimizer else None,
                     {k: v for k, v in full[model[0]].items() if k in expected},
                     full[optimizer[0]] if optimizer else None)
    loaded = {model[0]} | ({optimizer[0]} if optimizer else set())
    return restore_rest(state, loaded, metadata)
