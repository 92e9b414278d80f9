"""What every GPU check shares: the result row, the run context (GPU or dry run), model and data builders, clocks
and memory high-water marks that work on CUDA and (for the dry run) on CPU.

Runs on the GPU machine's own stack (torch 2.11, transformers 5.17, lightning 2.6.6) as well as on the pinned one:
only APIs both have are used, and the two that moved between them are looked up by name (``kernel_time_us``).
"""

from __future__ import annotations

import gc
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from gpu_checks.rows import Row, skipped  # noqa: F401  (re-exported for the checks)

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Context:
    """What a check needs to know of the run: a dry run uses CPU and tiny sizes, a real one CUDA and the configs."""

    dry: bool
    work: Path  # scratch space (recipe outputs, data), removed after the run
    log: Callable[[str], None] = print

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.dry else torch.device("cuda", 0)

    @property
    def accelerator(self) -> str:
        return "cpu" if self.dry else "cuda"


# -- models and data ---------------------------------------------------------------------------------------------
TINY_LLAMA = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "tie_word_embeddings": False}


def recipe(path: str) -> dict[str, Any]:
    """A recipe YAML of configs/ (``model:``, ``data:``, ``train:``)."""
    from disttrain.nlp import read_recipe_config

    return read_recipe_config(ROOT / path)


def model_args(config: str, layers: Optional[int] = None, dry: bool = False) -> dict[str, Any]:
    """The ``model:`` mapping of a recipe YAML (or the tiny one in a dry run), with ``layers`` blocks if given."""
    args = dict(TINY_LLAMA) if dry else dict(recipe(config)["model"])
    if layers is not None:
        args["num_hidden_layers"] = layers
    return args


def build_llama(args: dict[str, Any], device: Optional[torch.device] = None, seed: int = 0,
                attn: str = "sdpa") -> torch.nn.Module:
    """A Llama causal LM of ``args`` (LlamaConfig keywords) with random weights, created on ``device`` directly
    (fast on a GPU, and the same weights for the same seed: variants compared in one check start equal), or in the
    device context the caller opened (``fabric.init_module(empty_init=True)``) when ``device`` is None."""
    from disttrain.nlp import build_model, llama_config

    config = llama_config({"model": args}, use_cache=False)
    torch.manual_seed(seed)
    if device is None:
        return build_model(config, attn)
    with torch.device(device):
        return build_model(config, attn)


def llama_on_meta(args: dict[str, Any], attn: str = "sdpa") -> torch.nn.Module:
    from disttrain.nlp import build_model, llama_config

    with torch.device("meta"):
        return build_model(llama_config({"model": args}, use_cache=False), attn)


def learnable_batches(vocab: int, batch: int, seq: int, n: int, device: torch.device,
                      seed: int = 0) -> list[torch.Tensor]:
    """``n`` batches of token rows that follow a fixed rule (next = (17 * current + 31) mod m, random starts), so
    the loss falls within a few steps and two precisions can be compared on a curve that moves."""
    m = min(vocab, 997)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        rows = [torch.randint(0, m, (batch, 1), generator=g)]
        for _ in range(seq - 1):
            rows.append((rows[-1] * 17 + 31) % m)
        out.append(torch.cat(rows, dim=1).to(device))  # (batch, seq)
    return out


def fabric(ctx: Context, strategy: Any, precision: str = "bf16-mixed", plugins: Any = None) -> Any:
    """A one-device Fabric under ``strategy`` (CUDA and NCCL, or CPU and gloo in a dry run), launched."""
    import lightning as L

    import disttrain  # noqa: F401  (registers the disttrain_* names)

    kwargs: dict[str, Any] = {"plugins": plugins} if plugins is not None else {"precision": precision}
    f = L.Fabric(accelerator=ctx.accelerator, devices=1, strategy=strategy, **kwargs)
    f.launch()
    return f


# -- clocks and memory -------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall seconds of ``fn()``, with the device's queue drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _status_kib(field_name: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field_name}:\s+(\d+) kB", f.read(), re.M)
        return int(match.group(1)) if match else None
    except OSError:
        return None


class HostPeak:
    """This process's resident-set high-water mark over a block, in bytes.

    Linux lets a process reset its high-water mark (``echo 5 > /proc/self/clear_refs``); where that is refused
    (some sandboxes) a thread samples the resident set every 20 ms instead."""

    def __enter__(self) -> "HostPeak":
        import threading

        self.peak = 0
        self.start = (_status_kib("VmRSS") or 0) * 1024
        self._exact = False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._exact = _status_kib("VmHWM") is not None
        except OSError:
            pass
        self._stop = threading.Event()
        self._thread = None
        if not self._exact:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, me.memory_info().rss)
            self._stop.wait(0.02)

    def __exit__(self, *exc: object) -> None:
        if self._exact:
            self.peak = (_status_kib("VmHWM") or 0) * 1024
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()

    @property
    def above_start(self) -> int:
        return max(0, self.peak - self.start)

    @property
    def method(self) -> str:
        return "VmHWM after clear_refs" if self._exact else "RSS sampled every 20 ms"


class DevicePeak:
    """Peak bytes allocated on the CUDA device over a block, above what was allocated when it started
    (``torch.cuda.max_memory_allocated``). On CPU there is no allocator statistic: ``peak`` stays None."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak: Optional[int] = None

    def __enter__(self) -> "DevicePeak":
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base

    @property
    def above_start(self) -> Optional[int]:
        return self.peak


def gib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def mib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def relative_error(estimate: float, measured: float) -> float:
    return (estimate - measured) / measured


def max_relative_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def max_diff_of_start(losses: list[float], reference: list[float]) -> float:
    """The largest step-by-step gap between two loss curves, as a fraction of the reference's first loss. Unlike a
    relative difference per step, it stays sound once training drives the loss near zero (0.050 vs 0.049 is 2% of
    the late loss, but 0.01% of a start at 10)."""
    return max(abs(x - y) for x, y in zip(losses, reference)) / max(abs(reference[0]), 1e-12)


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a process this check starts: without the rendezvous variables this process's own
    Fabric set (MASTER_PORT is taken by its process group; a child reusing it fails with EADDRINUSE)."""
    drop = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
            "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("TORCHELASTIC_", "LT_"))}
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def guarded(check: str, item: str, target: str, measure: Callable[[], Any]) -> list[Row]:
    """``measure()``'s row(s), or one failed row naming the error: one part of a check failing must not hide the
    parts after it."""
    import traceback

    try:
        result = measure()
        free_memory()  # what measure() built is unreachable now; cycles (hooks, Fabric) need the collector
        return result if isinstance(result, list) else [result]
    except Exception as e:  # noqa: BLE001  (the report says what broke)
        traceback.print_exc()
        free_memory()
        return [Row(check, item, "-", target, False, f"{type(e).__name__}: {e}"[:600])]
