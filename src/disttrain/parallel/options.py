"""Strategy options as dataclasses, with one clear error for a misspelt or unknown option."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, TypeVar

T = TypeVar("T")


class OptionError(ValueError):
    """Strategy options that cannot run as given: an unknown or misplaced option, a value or combination the strategy
    refuses, sizes the world does not divide. Its message is one line naming the values and the fix, raised before any
    process group exists; launchers and recipes print that line alone (``parallel.guards.failures``)."""


class UnknownOptionError(OptionError, TypeError):
    """A keyword that is not an option of the strategy (a ``TypeError``, as Python's own for an unexpected keyword)."""


def as_option_error(error: Exception) -> OptionError:
    """``error`` as an :class:`OptionError` with its message (an :class:`UnknownOptionError` for a ``TypeError``): what
    an options dataclass's own checks raise, for the places that build a strategy's options."""
    if isinstance(error, OptionError):
        return error
    return (UnknownOptionError if isinstance(error, TypeError) else OptionError)(str(error))


# Options of Lightning's own FSDPStrategy, DeepSpeedStrategy and ModelParallelStrategy that a disttrain strategy
# names otherwise (or does without): an unknown one of these says what to pass instead, where a spelling match
# would mislead (data_parallel_size is not tensor_parallel_size). docs/migrating.md has the full tables.
def _in_config(section: tuple[str, ...], keys: dict[str, str]) -> dict[str, str]:
    """Lightning's DeepSpeed options that are keys of a DeepSpeed config section (Lightning's name -> DeepSpeed's)."""
    def path(key: str) -> str:
        inner = f"{{{key!r}: ...}}"
        for part in reversed(section):
            inner = f"{{{part!r}: {inner}}}"
        return f"config={inner}"

    return {name: path(key) for name, key in keys.items()}


LIGHTNING_OPTIONS = {
    "auto_wrap_policy": "wrap_classes= the block classes (found automatically by default)",
    "activation_checkpointing_policy": "activation_checkpointing=True (each block)",
    "sharding_strategy": "FULL_SHARD is the default; SHARD_GRAD_OP is reshard_after_forward=False, HYBRID_SHARD is"
                         " hybrid_shard=True, NO_SHARD is disttrain_ddp",
    "state_dict_type": "'sharded' is the default; 'full' is save_distributed_checkpoint=False",
    "mixed_precision": "the Trainer's or Fabric's precision= (bf16 compute, fp32 gradient reduction)",
    "device_mesh": "hybrid_shard=True with shard_size= the second size",
    "checkpoint_io": "checkpoints are folders the strategy writes itself",
    "stage": "disttrain_zero3 is ZeRO stage 3",
    "zero_optimization": "disttrain_zero3 is ZeRO stage 3",
    "offload_params_device": "offload_parameters='cpu' or 'nvme'",
    "offload_optimizer_device": "offload_optimizer='cpu' or 'nvme'",
    "remote_device": "offload_parameters='cpu' or 'nvme'",
    "load_full_weights": "a single file with optimizer state resumes as it is",
    "logging_batch_size_per_gpu": "the batch size is read from the DataLoader",
    "logging_level": "deepspeed.utils.logger.setLevel(...)",
    "zero_allow_untested_optimizer": "any torch optimizer is allowed",
    "exclude_frozen_parameters": "checkpoints hold every parameter",
    "data_parallel_size": "data parallel takes the ranks the other sizes leave",
    **_in_config(("zero_optimization",), {k: k for k in (
        "sub_group_size", "contiguous_gradients", "overlap_comm", "allgather_partitions", "reduce_scatter",
        "allgather_bucket_size", "reduce_bucket_size")}),
    **_in_config(("zero_optimization", "offload_param"), {"params_buffer_count": "buffer_count",
                                                            "params_buffer_size": "buffer_size",
                                                            "max_in_cpu": "max_in_cpu", "pin_memory": "pin_memory"}),
    **_in_config(("zero_optimization", "offload_optimizer"), {"optimizer_buffer_count": "buffer_count"}),
    **_in_config(("aio",), {k: k for k in ("block_size", "queue_depth", "single_submit", "overlap_events",
                                         "thread_count")}),
    **_in_config(("fp16",), {k: k for k in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                                          "min_loss_scale")}),
    **_in_config(("activation_checkpointing",), {k: k for k in (
        "partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
        "synchronize_checkpoint_boundary")}),
}


def build_options(cls: type[T], strategy: str, options: dict[str, Any], lightning_hints: bool = False) -> T:
    """``cls(**options)``, but an unknown key names the strategy, the closest valid option and the full list (with
    ``lightning_hints``, a strategy's options: for an option of Lightning's own strategies, what to pass here instead).
    An option other strategies take that this one cannot serve is listed in the class's ``refused`` (``{option: why,
    and what to use}``): set, it is that one line.
    """
    valid = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    refused: dict[str, str] = getattr(cls, "refused", {})
    for key, value in options.items():
        if key in refused and key not in valid:
            if value in (None, False):
                continue  # the option's default: nothing asked
            raise OptionError(f"{key}={value!r} is not supported by {strategy}: {refused[key]}")
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            if lightning_hints and key in LIGHTNING_OPTIONS:
                hint = f"as Lightning's option, here: {LIGHTNING_OPTIONS[key]} (docs/migrating.md); "
            raise UnknownOptionError(
                f"unknown option {key!r} for strategy {strategy!r}; {hint}valid options are: {', '.join(valid)}"
            )
    return cls(**{k: v for k, v in options.items() if k in valid})
