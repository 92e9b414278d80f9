"""Activations and FLOPs of any model, measured by running its forward on the meta device.

For models outside the analytically counted families (Llama, timm ViT, DeepFM), the planner runs the model's own
forward with meta tensors in place of its parameters and inputs (``torch.func.functional_call``: nothing is
allocated, nothing is computed, the user's module is not copied) and records what autograd saves for backward
through ``saved_tensors_hooks``, as ``measure.SavedActivations`` does on a real device:

- unique storages, counted once (views share them), parameters excluded;
- attributed to the repeated block running when they were saved (``find_blocks``): the rest is the model's base
  (embeddings, head, loss); a block's input is recorded too, which is what activation checkpointing keeps;
- inside a block, what a tensor-parallel plan splits: everything saved after a column-wise layer produced its
  output and until the next row-wise layer finished (the heads' q/k/v, attention output, the MLP's hidden
  activations);
- ``scaled_dot_product_attention`` is counted as the fused kernels (FlashAttention-2 on GPU, the CPU flash kernel)
  save it: q, k, v, the output and a per-head log-sum-exp, not the seq x seq scores that the meta device's math
  fallback would keep. A model built with eager attention keeps its scores and they are counted.

FLOPs come from torch's ``FlopCounterMode`` during the same forward. Results are per micro-batch and sequence
length, measured on first use and kept.
"""

from __future__ import annotations

from contextlib import contextmanager

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from disttrain.parallel.mesh import ParallelDims

Inputs = Callable[[int, int], tuple[tuple, dict]]  # (micro_batch, seq_len) -> (args, kwargs) on the meta device


@dataclass(frozen=True)
class Saved:
    """Bytes saved for backward, floating point apart from the rest (integer ids, masks): only the floating
    part follows the compute precision."""

    floating: int = 0
    other: int = 0

    def __add__(self, other: Saved) -> Saved:
        return Saved(self.floating + other.floating, self.other + other.other)

    def bytes(self, compute_bytes: int = 4, split: int = 1) -> float:
        """Bytes at ``compute_bytes`` per floating element (measured in fp32), divided by ``split``."""
        return (self.floating * compute_bytes / 4 + self.other) / split


@dataclass(frozen=True)
class Profile:
    """One forward's saved bytes: ``base`` outside the blocks, per block its replicated and tensor-parallel-split
    parts and its input, and the forward's FLOPs."""

    base: Saved = Saved()
    blocks_replicated: tuple[Saved, ...] = ()
    blocks_split: tuple[Saved, ...] = ()
    block_inputs: tuple[Saved, ...] = ()
    flops: float = 0.0

    def activation_bytes(self, compute_bytes: int, dims: ParallelDims | None = None,
                         activation_checkpointing: bool = False) -> int:
        """Bytes one rank of ``dims`` saves (tensor parallelism splits what the plan splits)."""
        t = dims.tp if dims is not None else 1
        per_block = [r.bytes(compute_bytes) + s.bytes(compute_bytes, t)
                     for r, s in zip(self.blocks_replicated, self.blocks_split)]
        base = self.base.bytes(compute_bytes)
        if activation_checkpointing and per_block:
            # Each block keeps only its input; backward recomputes one block at a time.
            inputs = sum(i.bytes(compute_bytes) for i in self.block_inputs)
            return int(base + inputs + max(per_block))
        return int(base + sum(per_block))


class _FusedAttention(torch.autograd.Function):
    """SDPA as the fused kernels keep it for backward: q, k, v, the output and a float32 log-sum-exp per head and
    query (and the mask when there is one). Only shapes are computed (meta tensors)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        shape = (*q.shape[:-1], v.shape[-1])  # (B, heads, T, head_dim)
        if len(shape) == 4:  # the kernels write (B, T, heads, head_dim) and return it transposed: the usual
            # transpose(1, 2).reshape(B, T, -1) that follows is then a view, not a copy
            out = torch.empty(shape[0], shape[2], shape[1], shape[3], dtype=q.dtype, device=q.device).transpose(1, 2)
        else:
            out = torch.empty(shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        saved = (q, k, v, out, lse) + ((mask,) if isinstance(mask, torch.Tensor) else ())
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # never run: the planner measures forward only
        raise RuntimeError("the planner's attention stand-in has no backward")


class _CountFusedAttention(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            # Dropout, causality and scale change no saved shape: the fused kernels regenerate dropout from the RNG
            # state instead of storing a mask.
            q, k, v, *rest = args
            return _FusedAttention.apply(q, k, v, kwargs.get("attn_mask", rest[0] if rest else None))
        return func(*args, **kwargs)


def _storage_key(t: torch.Tensor) -> int:
    # Meta storages have no data pointer; the storage object's handle tells views of one storage apart from others.
    return t.untyped_storage()._cdata


@dataclass
class _Recorder:
    """Which scope is running while autograd saves tensors: a block index (or None: the base) and whether the
    block is inside a tensor-parallel split region."""

    block: Optional[int] = None
    split: bool = False
    first_seen: dict[int, tuple[Optional[int], bool, torch.Tensor]] = field(default_factory=dict)
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self.first_seen:
            self.first_seen[key] = (self.block, self.split, t)
        return t


def _enter_block(recorder: _Recorder, index: int) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        recorder.block, recorder.split = index, False
        hidden = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        if isinstance(hidden, torch.Tensor):
            recorder.inputs.setdefault(index, hidden)

    return hook


def _leave_block(recorder: _Recorder) -> Callable:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        recorder.block, recorder.split = None, False

    return hook


def _split_hook(recorder: _Recorder, opens: bool) -> Callable:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        recorder.split = opens

    return hook


def _saved(tensors: list[torch.Tensor]) -> Saved:
    floating = sum(t.untyped_storage().nbytes() for t in tensors if t.is_floating_point())
    other = sum(t.untyped_storage().nbytes() for t in tensors if not t.is_floating_point())
    return Saved(floating, other)


def _split_modules(block: nn.Module, plan: Optional[dict]) -> tuple[list[nn.Module], list[nn.Module]]:
    """(column-wise, row-wise) submodules of a block under ``plan`` (a TP plan: path -> style)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    cols, rows = [], []
    for path, style in (plan or {}).items():
        try:
            module = block.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(style, ColwiseParallel):
            cols.append(module)
        elif isinstance(style, RowwiseParallel):
            rows.append(module)
    return cols, rows


def measure(model: nn.Module, inputs: tuple[tuple, dict], blocks: list[nn.Module],
            plan: Optional[dict] = None) -> Profile:
    """Run ``model(*args, **kwargs)`` on the meta device and profile what it saves for backward (see the module
    docstring). ``inputs``: meta tensors; ``blocks``: the repeated blocks of ``model``; ``plan``: a tensor-parallel
    plan for them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    # Fake tensors over meta storage rather than bare meta tensors: libraries skip their data-dependent checks
    # for fake tensors (transformers' packed-sequence test on position ids), which meta tensors cannot answer.
    fake = FakeTensorMode(allow_non_fake_inputs=True)

    def fake_of(t: Any) -> Any:
        return fake.from_tensor(t.to("meta")) if isinstance(t, torch.Tensor) else t

    # One tensor per parameter and buffer (tied ones once: functional_call ties them again); parameters require
    # gradients, so that autograd saves what backward needs.
    state = {name: fake_of(t).requires_grad_(t.requires_grad) for name, t in model.named_parameters()}
    state.update({name: fake_of(t) for name, t in model.named_buffers()})
    params = {_storage_key(t) for name, t in state.items()}
    recorder = _Recorder()
    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(_enter_block(recorder, i), with_kwargs=True))
        handles.append(block.register_forward_hook(_leave_block(recorder)))
        cols, rows = _split_modules(block, plan)
        handles += [m.register_forward_hook(_split_hook(recorder, True)) for m in cols]
        handles += [m.register_forward_hook(_split_hook(recorder, False)) for m in rows]
    args, kwargs = inputs
    args, kwargs = tuple(fake_of(a) for a in args), {k: fake_of(v) for k, v in kwargs.items()}
    counter = FlopCounterMode(display=False, custom_mapping=_grouped_mm_flops())
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), _CountFusedAttention(), counter, \
                fake:
            functional_call(model, state, args, kwargs, tie_weights=True, strict=False)
    finally:
        for handle in handles:
            handle.remove()
    base: list[torch.Tensor] = []
    replicated: list[list[torch.Tensor]] = [[] for _ in blocks]
    split: list[list[torch.Tensor]] = [[] for _ in blocks]
    for key, (block, in_split, t) in recorder.first_seen.items():
        if key in params:
            continue
        if block is None:
            base.append(t)
        else:
            (split if in_split else replicated)[block].append(t)
    block_inputs = tuple(_saved([recorder.inputs[i]]) if i in recorder.inputs else Saved() for i in range(len(blocks)))
    return Profile(base=_saved(base), blocks_replicated=tuple(_saved(ts) for ts in replicated),
                   blocks_split=tuple(_saved(ts) for ts in split), block_inputs=block_inputs,
                   flops=float(counter.get_total_flops()))


class MeasuredModel:
    """A model and a way to make its inputs at (micro_batch, seq_len); profiles are measured on first use and
    kept. ``what`` says in words what the inputs are (for the plan's notes)."""

    def __init__(self, model: nn.Module, inputs: Inputs, blocks: list[nn.Module], plan: Optional[dict] = None,
                 what: str = "") -> None:
        self.model, self.inputs, self.blocks, self.plan, self.what = model, inputs, blocks, plan, what
        self._profiles: dict[tuple[int, int], Profile] = {}

    def profile(self, micro_batch: int, seq_len: int) -> Profile:
        key = (micro_batch, seq_len)
        if key not in self._profiles:
            was_training = self.model.training
            self.model.train()  # what is saved for backward: the training forward (dropout, batch statistics)
            try:
                with _measurable_experts(self.model):
                    self._profiles[key] = measure(self.model, self.inputs(micro_batch, seq_len), self.blocks,
                                                  self.plan)
            except Exception as e:  # a forward that needs real data (or real devices) cannot be planned this way
                raise ValueError(
                    f"the planner cannot run {type(self.model).__name__}'s forward on the meta device with"
                    f" {self.what} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); plan from a"
                    " config instead: a LightningModule attribute planner_model, or AutoStrategy(model=...), naming"
                    " an HF config, a timm model name, a recipe YAML or a disttrain.planner.ModelSpec") from e
            finally:
                self.model.train(was_training)
        return self._profiles[key]


@contextmanager
def _measurable_experts(model: nn.Module) -> Iterator[None]:
    """HF MoE experts measured through transformers' own grouped-matmul fallback op while the model is profiled:
    torch's ``_grouped_mm`` has no meta kernel for float32 (it checks for bfloat16 before computing a shape), and
    transformers' op has one and saves for backward what the grouped matmul saves (its input; the weights are
    parameters). Its FLOPs are counted by :func:`_grouped_mm_flops`."""
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    if not hasattr(moe, "_can_use_grouped_mm") or not any(hasattr(m, "gate_up_proj") or hasattr(m, "down_proj")
                                                            for m in model.modules()):
        yield
        return
    original = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda *args, **kwargs: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


def _grouped_mm_flops() -> dict:
    """FlopCounterMode's formula for transformers' grouped matmul op: 2 x rows x in x out (every row meets one
    expert's weight)."""
    op = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if op is None:
        return {}

    def flops(input_shape: Any, weight_shape: Any, *args: Any, **kwargs: Any) -> int:
        return 2 * input_shape[0] * input_shape[1] * weight_shape[-1]

    return {op.default: flops}
