"""FlashAttention: switch a model's attention layers to the fastest exact kernel available.

Backends, best first:

1. ``flash_attention_2``: the ``flash-attn`` package (FlashAttention-2, with varlen kernels for packed sequences),
   used for Hugging Face transformers models when the package is importable and the run is on a CUDA GPU of
   compute capability >= 8.0 (Ampere or newer).
2. ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``. On CUDA its flash backend *is* FlashAttention-2
   (inside PyTorch) for fp16/bf16 inputs, with the memory-efficient kernel as fallback; on CPU it runs PyTorch's
   fused CPU flash kernel, or the math kernel where that does not apply.
3. whatever the layer had (``eager``) when neither can be switched on; the report says so.

All are exact attention: outputs equal the eager ``softmax(QK^T / sqrt(d)) V`` within floating-point tolerance.

Which layers are switched:

* Hugging Face ``PreTrainedModel`` (found anywhere inside the model): ``set_attn_implementation`` on the outermost
  one, which also reaches its sub-models. A model whose implementation is neither "eager" nor "sdpa" (flex,
  paged, flash_attention_3, a hub kernel) was chosen deliberately and is left alone.
* Any module with a boolean attribute ``fused_attn`` (timm's ``Attention``, ``AttentionRope``, attention pools)
  or ``use_sdpa`` (the protocol for our own modules): it is set to True. A module following the protocol must
  compute ``F.scaled_dot_product_attention`` when the flag is True and may keep an eager path for False.

Fabric users call :func:`apply_fast_attention` themselves (before or after ``fabric.setup``; it only flips
flags, so sharding is unaffected); Trainer users add the :class:`FlashAttention` callback.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

FLASH_ATTENTION_2 = "flash_attention_2"
SDPA = "sdpa"
EAGER = "eager"
# Attribute names of the "our own attention modules" protocol (fused_attn is timm's own name for the same switch).
SDPA_FLAGS = ("use_sdpa", "fused_attn")
# HF implementations we replace; anything else (flex_attention, paged|..., flash_attention_3, kernels) was picked
# deliberately by the user and is kept.
_HF_REPLACEABLE = (None, EAGER, SDPA)
_INSTALL_HINT = ("install it on a machine with an NVIDIA GPU of compute capability >= 8.0 (Ampere or newer) and "
                 "the CUDA toolkit: `pip install flash-attn --no-build-isolation` (or `pip install disttrain[flash]`); "
                 "or pass require=False to fall back to PyTorch SDPA, whose flash backend is FlashAttention-2 on CUDA")


def flash_attn_2_missing(device: torch.device | str | None = None) -> str | None:
    """Why the ``flash-attn`` package cannot be used for a run on ``device`` (default: cuda when present), or
    None when it can."""
    device = _default_device(device)
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed"
    if device.type != "cuda":
        return f"the run is on {device.type}, and flash-attn only has CUDA kernels"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"the GPU has compute capability {major}.{minor}; FlashAttention-2 needs 8.0 or newer"
    try:  # transformers refuses older releases (legacy workarounds): say so here rather than at the first step
        version = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        return "a module named flash_attn is importable but the flash-attn distribution is not installed"
    if tuple(int(p) for p in re.findall(r"\d+", version)[:3]) < (2, 3, 3):
        return f"flash-attn {version} is too old; transformers needs >= 2.3.3"
    return None


def sdpa_kernels(device: torch.device | str | None = None) -> str:
    """What ``sdpa`` means on ``device``, in words (for the report)."""
    if _default_device(device).type == "cuda":
        return "PyTorch SDPA; on CUDA its flash kernel is FlashAttention-2 (fp16/bf16), memory-efficient otherwise"
    return "PyTorch SDPA; on CPU its fused flash kernel for CPU, math kernel otherwise"


def apply_fast_attention(model: nn.Module, require: bool = False,
                         device: torch.device | str | None = None) -> dict[str, str]:
    """Switch every attention layer of ``model`` (in place) to the fastest exact backend for a run on ``device``.

    ``device``: where the model will run (default: cuda when present, else cpu); it decides whether the
    flash-attn package can be used. ``require=True``: raise ``RuntimeError`` unless FlashAttention-2 proper (the
    flash-attn package on a supported GPU) is available. Returns layer name -> backend ("flash_attention_2",
    "sdpa", "eager", or an HF implementation that was kept), one entry per attention layer found; empty when
    the model has none we recognise (yet: a model built in ``configure_model`` has no layers at ``setup``).
    Calling it again is harmless.
    """
    device = _default_device(device)
    missing = flash_attn_2_missing(device)
    if require and missing is not None:
        raise RuntimeError(f"FlashAttention(require=True): FlashAttention-2 is not available because {missing}; "
                           f"{_INSTALL_HINT}.")
    report: dict[str, str] = {}
    hf_roots = _hf_roots(model)
    for name, root in hf_roots:
        report.update(_switch_hf(name, root, prefer_flash=missing is None, require=require))
    for name, module in model.named_modules():
        if any(_inside(name, root) for root, _ in hf_roots):
            continue  # HF layers were switched through their config above
        flags = [f for f in SDPA_FLAGS if isinstance(getattr(module, f, None), bool)]
        if flags:
            for flag in flags:
                setattr(module, flag, True)
            report[name or type(module).__name__] = SDPA
    return report


def format_report(report: dict[str, str], device: torch.device | str | None = None,
                  max_names: int = 4) -> str:
    """The report as a few lines: one per backend, with its layer count and the first layer names."""
    if not report:
        return "FlashAttention: no attention layer found"
    by_backend: dict[str, list[str]] = {}
    for name, backend in report.items():
        by_backend.setdefault(backend, []).append(name)
    lines = [f"FlashAttention: {len(report)} attention layer(s)"]
    for backend, names in by_backend.items():
        shown = ", ".join(names[:max_names]) + (f", ... ({len(names) - max_names} more)" if len(names) > max_names
                                                else "")
        what = {SDPA: sdpa_kernels(device), FLASH_ATTENTION_2: "flash-attn package (FlashAttention-2)",
                EAGER: "not switched: plain softmax(QK^T/sqrt(d))V"}.get(backend, "kept as the model chose")
        lines.append(f"  {backend} [{what}]: {len(names)} -> {shown}")
    return "\n".join(lines)


class FlashAttention(Callback):
    """Switches a model's attention to the fastest exact kernel available (see this module's docstring).

    ``FlashAttention(require=False)``: use FlashAttention-2 (flash-attn) when it can run, PyTorch SDPA otherwise.
    ``require=True``: fail at ``setup`` with an error naming what is missing when flash-attn cannot run.

    Layers are switched at ``setup`` (before the strategy shards or wraps the model) and again at the start of
    fit/validate/test/predict, which reaches models built in ``configure_model`` (Lightning calls it after the
    callbacks' ``setup``). Only flags change, so switching after sharding is safe. ``self.report`` holds layer
    name -> backend; it is printed on rank 0 whenever it changes.
    """

    def __init__(self, require: bool = False) -> None:
        self.require = require
        self.report: dict[str, str] = {}

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._apply(trainer, pl_module, last_chance=False)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._apply(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._apply(trainer, pl_module)

    def on_test_start(self, trainer, pl_module) -> None:
        self._apply(trainer, pl_module)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._apply(trainer, pl_module)

    def _apply(self, trainer, pl_module, last_chance: bool = True) -> None:
        device = trainer.strategy.root_device
        report = apply_fast_attention(pl_module, require=self.require, device=device)
        if report != self.report:
            self.report = report
            rank_zero_info(format_report(report, device))
        elif not report and last_chance and not getattr(self, "_warned", False):
            self._warned = True
            rank_zero_warn(f"FlashAttention found no attention layer in {type(pl_module).__name__}: it switches "
                           f"Hugging Face PreTrainedModels and modules with a boolean {' or '.join(SDPA_FLAGS)} "
                           "attribute (timm's Attention, or your own module following that protocol).")


def _default_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _hf_roots(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost HF ``PreTrainedModel``s in ``model`` (their own ``set_attn_implementation`` reaches the rest)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers is optional for timm-only or custom models
        return []
    roots: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel) and not any(_inside(name, r) for r, _ in roots):
            roots.append((name, module))
    return roots


def _inside(name: str, root: str) -> bool:
    return root == "" or name == root or name.startswith(root + ".")


def _switch_hf(name: str, model: nn.Module, prefer_flash: bool, require: bool) -> dict[str, str]:
    current = model.config._attn_implementation
    if current in _HF_REPLACEABLE:
        for backend in ([FLASH_ATTENTION_2] if prefer_flash else []) + [SDPA]:
            try:
                model.set_attn_implementation(backend)
                break
            except (ImportError, ValueError) as err:
                # e.g. an architecture without an SDPA or flash path: keep what it has unless FA-2 was required
                if require and backend == FLASH_ATTENTION_2:
                    raise RuntimeError(f"FlashAttention(require=True): {type(model).__name__} at "
                                       f"'{name or '<root>'}' cannot use flash_attention_2: {err}") from err
    # Report what the layers will really read in forward: set_attn_implementation only warns when it cannot switch.
    layers = {_join(name, sub): m.config._attn_implementation for sub, m in model.named_modules()
              if "Attention" in type(m).__name__ and hasattr(getattr(m, "config", None), "_attn_implementation")}
    return layers or {name or type(model).__name__: model.config._attn_implementation}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name
