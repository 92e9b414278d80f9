"""Throughput and MFU: tokens (or samples) per second, achieved TFLOP/s and model FLOPs utilisation per device, and
the peak memory of every rank — for the Trainer (a ``Callback``) and for Fabric (``tp.step(fabric, batch)``).

What is Lightning's and what is ours:

- The rolling rate over the last ``window_size`` optimizer steps is Lightning's ``Throughput``
  (``lightning.fabric.utilities.throughput``), used per rank. Lightning's global numbers are the per-device ones
  times ``world_size``, which is right only when every rank is a data-parallel replica with the same batch; ours
  are summed over the ranks (one small all-gather per report) and scaled by ``data_parallel_size / world_size`` so
  ranks of one tensor-parallel group are counted once.
- FLOPs of a non-transformer model come from Lightning's ``measure_flops``, run once on the meta device
  (``measure_train_flops``). Transformer LMs use the analytic count (``transformer_flops_per_token``), which
  needs no model run and is what published MFU figures use.
- The peak table is ours: Lightning's ``get_available_flops`` mixes dense and 2:4-sparse datasheet figures (its
  H200 bf16 entry, 2.0e15, is the sparse one, which would halve an H200's MFU), returns None for a device it does
  not know and takes no user value. Ours holds dense figures only and accepts ``peak_flops=`` (required on CPU).
- Lightning's ``ThroughputMonitor`` callback logs on rank 0 only (no per-rank memory), needs a ``flops_per_batch``
  attribute on the module and prefixes keys with the stage; this callback is written on its own for those reasons.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.throughput import Throughput as _RateWindow
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.callbacks import Callback
from torch import nn

from disttrain.callbacks.accumulation import data_parallel_ranks
from disttrain.parallel.families.spec import transformer_flops_per_token

# Dense (no 2:4 sparsity) peak tensor-core FLOP/s per device, from NVIDIA's datasheets. The datasheets' starred
# figures are "with sparsity" and are twice these; dense training never reaches them.
#   A100: "NVIDIA A100 Tensor Core GPU" datasheet (SXM4 and PCIe have the same peaks).
#   H100 SXM / PCIe / NVL: "NVIDIA H100 Tensor Core GPU" datasheet (the sparse figures halved).
#   H200 SXM / NVL: "NVIDIA H200 Tensor Core GPU" datasheet (SXM: the same compute as H100 SXM).
#   L4: "NVIDIA L4 Tensor Core GPU" datasheet. T4: "NVIDIA T4" datasheet (Turing: no bf16, no tf32).
#   V100: "NVIDIA Tesla V100" datasheet ("Tensor Performance" is fp16 with fp32 accumulate).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "a100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "h100 sxm": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "h100 pcie": {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12},
    "h100 nvl": {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12},
    "h200 sxm": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "h200 nvl": {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12},
    "l4": {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12},
    "t4": {"fp32": 8.1e12, "fp16": 65e12},
    "v100 sxm": {"fp32": 15.7e12, "fp16": 125e12},
    "v100 pcie": {"fp32": 14e12, "fp16": 112e12},
}


def peak_table_name(device_name: str) -> str | None:
    """The ``PEAK_FLOPS`` row for a device name as ``torch.cuda.get_device_name`` spells it ("NVIDIA H100 80GB
    HBM3", "Tesla T4", "NVIDIA A100-SXM4-80GB") or as a user writes it ("h100", "A100"); None if not in the table."""
    name = device_name.lower()

    def has(model: str) -> bool:  # a whole model number: "a100" is in "a100-sxm4-80gb", not in "a1000" or "l40s"
        return re.search(rf"(?<![a-z0-9]){model}(?![0-9])", name) is not None

    for family in ("h200", "h100"):
        if has(family):
            if "nvl" in name:
                return f"{family} nvl"
            # "NVIDIA H100 80GB HBM3" is the SXM part; only the PCIe card says so in its name.
            return f"{family} pcie" if "pcie" in name and family == "h100" else f"{family} sxm"
    if has("a100"):
        return "a100"
    if has("v100"):
        return "v100 pcie" if "pcie" in name else "v100 sxm"
    for model in ("l4", "t4"):
        if has(model):
            return model
    return None


def precision_to_peak_dtype(precision: str, device_type: str = "cuda") -> str | None:
    """The ``PEAK_FLOPS`` column a Lightning precision string computes in ("bf16-mixed" -> "bf16"); None for
    precisions the table has no column for (64-true, transformer-engine, bitsandbytes)."""
    p = str(precision)
    if p.startswith("bf16"):
        return "bf16"
    if p.startswith("16"):
        return "fp16"
    if p.startswith("32"):
        # fp32 matmuls run on TF32 tensor cores unless the user asked for "highest" (Ampere and later).
        tf32 = device_type == "cuda" and torch.get_float32_matmul_precision() != "highest"
        return "tf32" if tf32 else "fp32"
    return None


def peak_flops_per_device(device_name: str, dtype: str) -> float:
    """Peak dense FLOP/s of one device of the table, e.g. ``peak_flops_per_device("A100", "bf16") == 312e12``."""
    row_name = peak_table_name(device_name)
    if row_name is None:
        raise ValueError(f"peak_flops={device_name!r} is not a device of the peak table (known: "
                         f"{', '.join(PEAK_FLOPS)}); pass the peak FLOP/s of one device as a number instead, "
                         f"e.g. peak_flops=312e12")
    row = PEAK_FLOPS[row_name]
    if dtype == "tf32" and "tf32" not in row:  # pre-Ampere: fp32 matmuls run in fp32
        dtype = "fp32"
    if dtype not in row:
        raise ValueError(f"{device_name!r} ({row_name}) has no {dtype} peak in the table (it has "
                         f"{', '.join(row)}); train in one of those or pass peak_flops=<FLOP/s per device>")
    return row[dtype]


def mfu(flops_per_s: float, n_devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s of the whole job per device over one device's peak FLOP/s."""
    return flops_per_s / n_devices / peak_flops


@dataclass(frozen=True)
class TransformerDims:
    """What ``transformer_flops_per_token`` needs of a model: parameters without the input embedding, the number
    of layers and the attention width (heads x head dim, the hidden size in most models)."""

    n_params: int
    n_layers: int
    hidden: int


def _field(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{type(config).__name__} has none of {', '.join(names)}; pass "
                     f"transformer=TransformerDims(n_params=..., n_layers=..., hidden=...) instead")


def _global_numel(p: torch.Tensor) -> int:
    # A ZeRO-3 partition knows its full size as ds_numel; an FSDP2 DTensor's numel() is already the global one.
    return getattr(p, "ds_numel", p.numel())


def hf_transformer_dims(config_or_model: Any) -> TransformerDims:
    """``TransformerDims`` of a Hugging Face causal LM, from its model (sharded or not: FSDP2 and ZeRO-3 parameters
    count at full size) or from its config alone (the model is then built on the meta device, allocating nothing).

    The input embedding is left out of ``n_params`` unless it is tied to the output head, where it is a matmul. An
    MoE model counts its active parameters: of each layer's experts, the ``num_experts_per_tok`` a token meets.
    """
    if isinstance(config_or_model, nn.Module):
        model = config_or_model
    else:
        from transformers import AutoModelForCausalLM

        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config_or_model)
        except Exception as e:
            raise ValueError(f"cannot build a causal LM from {type(config_or_model).__name__} to count its "
                             f"parameters ({e}); pass the model itself, or transformer=TransformerDims(...)") from e
    config = model.config
    if hasattr(config, "get_text_config"):  # multimodal configs keep the LM's sizes in a sub-config
        config = config.get_text_config()
    n_params = sum(_global_numel(p) for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = (head is not None and head.weight is embedding) or bool(getattr(config, "tie_word_embeddings", False))
    if not tied:
        n_params -= _global_numel(embedding)
    from disttrain.parallel.families.hf_plans import expert_counts

    experts, per_layer, top_k = expert_counts(model)
    if experts and per_layer:  # MoE: a token meets top_k of each layer's experts (the active parameters)
        n_params -= round(experts * (1 - top_k / per_layer))
    heads, head_dim = getattr(config, "num_attention_heads", None), getattr(config, "head_dim", None)
    hidden = heads * head_dim if heads and head_dim else _field(config, "hidden_size", "n_embd", "d_model")
    return TransformerDims(n_params=n_params, n_layers=_field(config, "num_hidden_layers", "n_layer", "num_layers"),
                           hidden=hidden)


def measure_train_flops(build_model: Callable[[], nn.Module], forward: Callable[[nn.Module], torch.Tensor],
                        loss_fn: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.sum) -> int:
    """FLOPs of one training step (forward and backward) on one batch, counted by Lightning's ``measure_flops`` on
    a model built on the meta device: nothing is allocated and nothing runs. Inputs made inside ``forward`` land on
    the meta device too, e.g. ``measure_train_flops(lambda: timm.create_model("vit_base_patch16_224"),
    lambda m: m(torch.randn(32, 3, 224, 224)))``.
    """
    with torch.device("meta"):
        model = build_model()
        return measure_flops(model, lambda: forward(model), loss_fn)


def _find_hf_model(module: nn.Module) -> nn.Module | None:
    """The outermost Hugging Face model inside a LightningModule (or the module itself)."""
    for m in module.modules():
        if hasattr(m, "config") and hasattr(m, "get_input_embeddings") and hasattr(m, "get_output_embeddings"):
            return m
    return None


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        return _first_tensor(batch["input_ids"]) if "input_ids" in batch else next(
            (t for t in map(_first_tensor, batch.values()) if t is not None), None)
    if isinstance(batch, (list, tuple)) and batch:
        return _first_tensor(batch[0])
    return None


def _token_ids(batch: Any) -> torch.Tensor | None:
    """A ``(batch, seq)`` tensor of token ids: ``batch["input_ids"]``, an integer tensor, or the first of a tuple."""
    t = _first_tensor(batch)
    return t if t is not None and t.dim() >= 2 and not t.is_floating_point() else None


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory in MiB: CUDA's high-water mark of allocated tensors on a GPU (since the start or
    the last ``torch.cuda.reset_peak_memory_stats``), the resident set high-water mark on CPU (everything the process
    ever held since it started, Python and libraries included: the OS cannot reset it)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:  # Windows
        return math.nan
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


class Throughput(Callback):
    """Logs every ``every_n_steps`` optimizer steps, and keeps in ``self.metrics``:

    - ``throughput/tokens_per_s`` (all data-parallel ranks together), ``throughput/tokens_per_s_per_device``,
      ``throughput/samples_per_s``, ``throughput/steps_per_s``: rates over the last ``window_size`` steps (the
      first step, warm-up included, is never in a window; validation time is left out);
    - ``throughput/tflops_per_device``: when the FLOPs of a step are known; ``throughput/mfu``: when the peak
      FLOP/s of a device is known too;
    - ``memory/peak_mib`` (the largest over ranks) and ``memory/peak_mib_rank{r}`` for every rank;
    - ``comm/grad_bytes_per_step``: the bytes each rank sent to reduce gradients per optimizer step since the last
      report (mean over ranks), under strategies that count them (disttrain_ddp, disttrain_fsdp: see their
      ``gradient_compression``);
    - ``comm/table_bytes_per_step``: under disttrain_recsys, the bytes each rank handed to the sharded tables'
      all-to-alls per optimizer step (ids, pooled embeddings and their gradients; see its ``comm_precision``).

    Args:
        every_n_steps: report (and all-gather, one tiny collective) every this many optimizer steps.
        window_size: optimizer steps in the rolling rate (at least 2); default ``every_n_steps``.
        peak_flops: peak FLOP/s of one device as a number, or a device name of ``PEAK_FLOPS`` ("a100", "h100 sxm",
            ...) read in the column of the run's precision. Default: looked up from the GPU's name; on CPU the peak
            is unknown, so MFU is reported only with ``peak_flops=`` given.
        transformer: a Hugging Face model or config, or ``TransformerDims``: FLOPs per token by
            ``transformer_flops_per_token``. Default under the Trainer: the first HF model found in the
            LightningModule.
        flops_per_batch: FLOPs of one training step on one rank's micro-batch, for other models: a number, or a
            function called once at the start (e.g. ``lambda: measure_train_flops(build, forward)``).
        causal: count only the unmasked half of the attention scores (see ``transformer_flops_per_token``).
        tokens_per_batch / samples_per_batch: functions of a batch. Default: the numel of ``batch["input_ids"]``
            (or of an integer ``(batch, seq)`` tensor, or of a tuple's first element), padding included — it is
            computed on, so MFU counts it; pass e.g. ``lambda b: int(b["attention_mask"].sum())`` for useful
            tokens; samples are the first tensor's leading dimension.
        seq_len: sequence length for the attention term when it cannot be read from the batch.
        data_parallel_size: ranks that see different data; default: the strategy's data-parallel degree (the
            world size under DDP, FSDP, ZeRO; fewer under tensor, pipeline or context parallelism).

    Trainer: ``L.Trainer(callbacks=[Throughput(peak_flops="a100")])``; values go to every ``trainer.loggers``.
    Fabric: call ``tp.step(fabric, batch)`` on every rank after each optimizer step (with gradient accumulation,
    pass the step's total: ``tp.step(fabric, tokens=..., samples=...)``); values go to ``fabric.log_dict``::

        tp = Throughput(transformer=model.config, every_n_steps=10)
        for batch in loader:
            loss = model(**batch).loss; fabric.backward(loss); optimizer.step(); optimizer.zero_grad()
            tp.step(fabric, batch)
        print(tp.metrics["throughput/tokens_per_s"])
    """

    def __init__(self, every_n_steps: int = 10, window_size: int | None = None, peak_flops: float | str | None = None,
                 transformer: Any = None, flops_per_batch: float | Callable[[], float] | None = None,
                 causal: bool = False, tokens_per_batch: Callable[[Any], int] | None = None,
                 samples_per_batch: Callable[[Any], int] | None = None, seq_len: int | None = None,
                 data_parallel_size: int | None = None) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be at least 1")
        window_size = every_n_steps if window_size is None else window_size
        if window_size < 2:
            # A rate needs two time points; the window's first step only marks the start.
            raise ValueError(f"window_size={window_size} must be at least 2 (a rate needs two time points); "
                             f"pass window_size=2 or more, or every_n_steps=2 or more")
        if isinstance(peak_flops, bool) or (isinstance(peak_flops, (int, float)) and not peak_flops > 0):
            raise ValueError(f"peak_flops={peak_flops!r} must be the positive peak FLOP/s of one device, e.g. "
                             f"peak_flops=312e12 for an A100 in bf16, or a device name: {', '.join(PEAK_FLOPS)}")
        if isinstance(peak_flops, str):
            peak_flops_per_device(peak_flops, "fp32")  # an unknown name fails here, not after the first steps
        if transformer is not None and flops_per_batch is not None:
            raise ValueError("pass either transformer= (FLOPs per token) or flops_per_batch= (FLOPs per batch), "
                             "not both")
        if isinstance(flops_per_batch, (int, float)) and not flops_per_batch > 0:
            raise ValueError(f"flops_per_batch={flops_per_batch!r} must be positive")
        if data_parallel_size is not None and data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={data_parallel_size} must be at least 1")
        self.every_n_steps = every_n_steps
        self.window_size = window_size
        self.peak_flops = peak_flops
        self.dims = transformer if transformer is None or isinstance(transformer, TransformerDims) else \
            hf_transformer_dims(transformer)
        self.flops_per_batch = flops_per_batch
        self.causal = causal
        self.tokens_per_batch = tokens_per_batch
        self.samples_per_batch = samples_per_batch
        self.seq_len = seq_len
        self.data_parallel_size = data_parallel_size
        self.metrics: dict[str, float] = {}
        self._started = False

    # ---- the shared core: start, count a micro-batch, close an optimizer step, report ----

    def _start(self, device: torch.device, precision: str, world_size: int, module: nn.Module | None,
               strategy: Any = None, steps_done: int = 0) -> None:
        if self.dims is None and self.flops_per_batch is None and module is not None:
            hf = _find_hf_model(module)
            if hf is not None:
                self.dims = hf_transformer_dims(hf)
        if callable(self.flops_per_batch):
            self.flops_per_batch = float(self.flops_per_batch())  # measured once
        if self.dims is None and self.flops_per_batch is None:
            rank_zero_warn("Throughput: the FLOPs of a step are unknown (no transformer=, no flops_per_batch=, no Hugging"
                           " Face model in the LightningModule), so TFLOP/s and MFU are not reported; pass "
                           "transformer=<model, config or TransformerDims> or flops_per_batch=<number or "
                           "measure_train_flops(...)>")
        self._peak = self._resolve_peak(device, precision)
        self._device = device
        self._world_size = world_size
        # Ranks that see different data: the strategy's degrees (context/tensor/pipeline ranks share a batch).
        self._dp = self.data_parallel_size or data_parallel_ranks(strategy, world_size)
        if world_size % self._dp:
            raise ValueError(f"data_parallel_size={self._dp} does not divide the world size {world_size}; pass a "
                             f"divisor of {world_size} (the number of ranks that see different data)")
        # Per rank: world_size=1 keeps Lightning's window to this rank's own numbers; ranks are combined in _report.
        self._window = _RateWindow(world_size=1, window_size=self.window_size)
        self._steps, self._samples, self._tokens, self._step_flops = 0, 0, 0, 0.0
        self._counts_tokens = self._counts_samples = True
        self._t0 = time.perf_counter()
        self._paused_at: float | None = None
        self._started = True
        # Gradient traffic: the bytes the engine counted since the last report over the steps since then.
        engine = getattr(strategy, "engine", None)
        self._comm_bytes = getattr(engine, "comm_bytes", lambda: None)
        self._comm_mark = (self._comm_bytes(), steps_done)
        table_bytes = getattr(engine, "table_bytes", lambda: None)
        self._table_bytes = lambda: None if table_bytes() is None else sum(table_bytes().values())
        self._table_mark = (self._table_bytes(), steps_done)

    def _resolve_peak(self, device: torch.device, precision: str) -> float | None:
        if isinstance(self.peak_flops, (int, float)):
            return float(self.peak_flops)
        dtype = precision_to_peak_dtype(precision, device.type)
        if isinstance(self.peak_flops, str):
            if dtype is None:
                raise ValueError(f"precision={precision!r} has no column in the peak table; pass "
                                 f"peak_flops=<FLOP/s per device> as a number")
            return peak_flops_per_device(self.peak_flops, dtype)
        if device.type != "cuda":
            return None  # CPU peaks depend on cores, clocks and vector units: only the user knows it
        # Auto-detected: a GPU or precision the table lacks costs the MFU, not the training run.
        name = torch.cuda.get_device_name(device)
        if dtype is None:
            rank_zero_warn(f"Throughput: no MFU: precision={precision!r} has no column in the peak table; pass "
                           f"peak_flops=<FLOP/s per device>")
            return None
        try:
            return peak_flops_per_device(name, dtype)
        except ValueError as e:
            rank_zero_warn(f"Throughput: no MFU for the GPU {name!r}: {e}")
            return None

    def _count(self, batch: Any = None, tokens: int | None = None, samples: int | None = None) -> None:
        """Add one micro-batch (or explicit counts) of this rank to the current optimizer step."""
        ids = _token_ids(batch) if batch is not None else None
        if tokens is None:
            tokens = self.tokens_per_batch(batch) if self.tokens_per_batch else (
                ids.numel() if ids is not None else None)
        if samples is None:
            first = _first_tensor(batch) if batch is not None else None
            samples = self.samples_per_batch(batch) if self.samples_per_batch else (
                first.shape[0] if first is not None and first.dim() > 0 else None)
        self._counts_tokens &= tokens is not None
        self._counts_samples &= samples is not None
        self._tokens += tokens or 0
        self._samples += samples or 0
        if self.dims is not None:
            seq_len = self.seq_len or (ids.shape[-1] if ids is not None else None)
            if tokens is None or seq_len is None:
                raise ValueError(f"Throughput cannot count the tokens and sequence length of a {type(batch).__name__} "
                                 f"batch; pass tokens_per_batch=<function of the batch> and seq_len=<int>")
            d = self.dims
            self._step_flops += transformer_flops_per_token(d.n_params, d.n_layers, d.hidden, seq_len,
                                                            causal=self.causal) * tokens
        elif self.flops_per_batch is not None:
            self._step_flops += self.flops_per_batch

    def _close_step(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # otherwise the clock stops before the GPU has finished
        self._steps += 1
        # Lightning's window needs samples >= steps and tokens >= samples; unknown counts stand in as steps.
        samples = self._samples if self._counts_samples else self._steps
        self._window.update(time=time.perf_counter() - self._t0, batches=self._steps, samples=samples,
                            lengths=self._tokens if self._counts_tokens else None,
                            flops=self._step_flops if self._step_flops else None)
        self._step_flops = 0.0

    def _report(self, gather: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """All ranks call this together (one all-gather): sum the ranks' rates, take every rank's peak memory."""
        local = self._window.compute()
        nan = math.nan
        mine = [local.get("device/items_per_sec", nan) if self._counts_tokens else nan,
                local.get("device/samples_per_sec", nan) if self._counts_samples else nan,
                local.get("device/batches_per_sec", nan), local.get("device/flops_per_sec", nan),
                peak_memory_mib(self._device), self._comm_per_step(), self._table_per_step()]
        ranks = gather(torch.tensor(mine, dtype=torch.float64, device=self._device)).reshape(-1, len(mine)).cpu()
        tokens, samples, steps, flops, memory, comm, table = ranks.unbind(1)
        # Ranks of one tensor/pipeline-parallel group work on the same samples: count each group once.
        share = self._dp / self._world_size
        out: dict[str, float] = {}
        if not tokens.isnan().any():
            out["throughput/tokens_per_s"] = tokens.sum().item() * share
            out["throughput/tokens_per_s_per_device"] = out["throughput/tokens_per_s"] / self._world_size
        if not samples.isnan().any():
            out["throughput/samples_per_s"] = samples.sum().item() * share
        if not steps.isnan().any():
            out["throughput/steps_per_s"] = steps.mean().item()
        if not flops.isnan().any():
            job_flops = flops.sum().item() * share
            out["throughput/tflops_per_device"] = job_flops / self._world_size / 1e12
            if self._peak is not None:
                out["throughput/mfu"] = mfu(job_flops, self._world_size, self._peak)
        if not comm.isnan().any():
            out["comm/grad_bytes_per_step"] = comm.mean().item()
        if not table.isnan().any():
            out["comm/table_bytes_per_step"] = table.mean().item()
        out["memory/peak_mib"] = memory.max().item()
        out.update({f"memory/peak_mib_rank{r}": m for r, m in enumerate(memory.tolist())})
        self.metrics = out
        return out

    def _comm_per_step(self) -> float:
        """Bytes this rank sent to reduce gradients per optimizer step since the last report (NaN: not counted)."""
        return self._per_step("_comm_mark", self._comm_bytes())

    def _table_per_step(self) -> float:
        """Bytes this rank handed to the tables' all-to-alls per optimizer step since the last report (NaN: none)."""
        return self._per_step("_table_mark", self._table_bytes())

    def _per_step(self, mark: str, now: Optional[float]) -> float:
        """A byte counter's growth per optimizer step since its last reading (kept in attribute ``mark``)."""
        before, steps_before = getattr(self, mark)
        setattr(self, mark, (now, self._steps))
        if before is None or now is None or self._steps == steps_before:
            return math.nan
        return (now - before) / (self._steps - steps_before)

    # ---- Trainer hooks ----

    def on_train_start(self, trainer, pl_module) -> None:
        self._start(trainer.strategy.root_device, trainer.precision, trainer.world_size, pl_module,
                    trainer.strategy)
        self._last_global_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._count(batch)
        # global_step moves only when the optimizer steps: accumulation micro-batches add to the same step.
        if trainer.global_step == self._last_global_step:
            return
        self._last_global_step = trainer.global_step
        self._close_step()
        if trainer.global_step % self.every_n_steps == 0:
            metrics = self._report(trainer.strategy.all_gather)
            # Straight to the loggers rather than pl_module.log: self.log reaches them only on the Trainer's own
            # log_every_n_steps, which would drop reports made between its steps.
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._started and not trainer.sanity_checking:
            self._paused_at = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._started and self._paused_at is not None:
            self._t0 += time.perf_counter() - self._paused_at  # validation time is not training time
            self._paused_at = None

    # ---- Fabric ----

    def step(self, fabric, batch: Any = None, *, tokens: int | None = None,
             samples: int | None = None) -> dict[str, float]:
        """Count one optimizer step of this rank (its ``batch``, or ``tokens=``/``samples=``); every
        ``every_n_steps`` steps all ranks report together and log with ``fabric.log_dict``. Call on every rank.
        Returns the metrics of this report ({} between reports)."""
        if not self._started:
            # The clock starts here: like the Trainer's first step, this one (warm-up) is in no window. Fabric has
            # no LightningModule to search, so FLOPs come from transformer= or flops_per_batch= only.
            self._start(fabric.device, fabric.strategy.precision.precision, fabric.world_size, None,
                        fabric.strategy, steps_done=1)  # this step's gradients were reduced already
        self._count(batch, tokens=tokens, samples=samples)
        self._close_step()
        if self._steps % self.every_n_steps:
            return {}
        metrics = self._report(fabric.all_gather)
        fabric.log_dict(metrics, step=self._steps)
        return metrics
