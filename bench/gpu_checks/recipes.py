"""Check 8: the three recipes' smoke runs on the device, a few steps each, started as a user starts them (plain
``python``, one device): the dialogue LLM and the ViT under ``disttrain_fsdp``, the daily DeepFM job where
torchrec's kernels for the device are installed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

from gpu_checks.common import ROOT, Context, Row, child_env, guarded, skipped
from gpu_checks.training import optional_import

CHECK = "8 recipes"
STEPS = 4


def _run(cmd: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    env = child_env()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        proc = subprocess.CompletedProcess(cmd, -9, out, f"timed out after {timeout:.0f} s")
    return proc, time.perf_counter() - t0


def _failure(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in (proc.stderr or "").strip().splitlines() if line.strip()]
    return f"exit {proc.returncode}: {lines[-1] if lines else (proc.stdout or '').strip()[-300:]}"[:500]


def _accelerator(ctx: Context) -> str:
    return "cpu" if ctx.dry else "gpu"


def dialogue(ctx: Context, timeout: float) -> Row:
    out = ctx.work / "dialogue"
    # bf16 on the device; a dry run's CPU emulates bf16 matmuls (9x the fp32 step: 26 s of CPU for these 4 steps)
    precision = "32-true" if ctx.dry else "bf16-mixed"
    cmd = [sys.executable, "recipes/nlp/dialogue_llm.py", "--accelerator", _accelerator(ctx), "--devices", "1",
           "--strategy", "disttrain_fsdp", "--precision", precision, "--steps", str(STEPS), "--eval-every",
           str(STEPS), "--out", str(out), "--demo-root", str(ctx.work / "dialogue_data")]
    own_data = _own_dialogue_data(ctx.work / "dialogue_own") if optional_import("chatterbot_corpus") else None
    if own_data is not None:  # the demo corpus package was not carried: a small corpus written here instead
        cmd += ["--data", str(own_data[0]), "--tokenizer", str(own_data[1])]
    proc, seconds = _run(cmd, timeout)
    text = proc.stdout or ""
    ok = proc.returncode == 0 and f"done: {STEPS} steps" in text and (out / "hf" / "model.safetensors").is_file()
    before = re.search(r"held-out loss before training ([\d.]+)", text)
    after = re.findall(r"step +\d+ +train loss [\d.]+ +held-out loss ([\d.]+)", text)
    rate = re.findall(r"([\d,]+) tokens/s", text)
    figure = (f"{STEPS} steps in {seconds:.0f} s (process included); held-out loss "
              f"{before.group(1) if before else '?'} -> {after[-1] if after else '?'}; "
              f"{rate[-1] if rate else '?'} tokens/s; HF export written")
    return Row(CHECK, f"dialogue_llm.py, tiny config, disttrain_fsdp, {precision}, 1 {ctx.device.type} device"
               + (" (own corpus: chatterbot-corpus not installed)" if own_data else ""),
               figure if ok else "-", "runs, trains, exports", ok, "" if ok else _failure(proc),
               details={"stdout_tail": text[-1500:]})


def _own_dialogue_data(folder: Path) -> Optional[tuple[Path, Path]]:
    """A small chat JSONL and a tokenizer trained on it, for machines without the chatterbot-corpus package."""
    from disttrain.nlp.corpus import train_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    jsonl, tok = folder / "chats.jsonl", folder / "tokenizer"
    topics = ["the weather", "a good book", "the train home", "dinner tonight", "the garden", "music", "tea"]
    with open(jsonl, "w", encoding="utf-8") as f:
        for i in range(400):
            topic = topics[i % len(topics)]
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"What do you think about {topic}? ({i})"},
                {"role": "assistant", "content": f"I like {topic} a lot, thank you for asking about {topic}."}]})
                + "\n")
    if not (tok / "tokenizer.json").is_file():
        train_tokenizer(jsonl, tok, vocab_size=512)
    return jsonl, tok


def vit(ctx: Context, timeout: float) -> Row:
    out = ctx.work / "vit"
    cmd = [sys.executable, "recipes/vision/vit2b.py", "--config", "configs/vision/vit_tiny.yaml", "--accelerator",
           _accelerator(ctx), "--devices", "1", "--strategy", "disttrain_fsdp", "--max-steps", str(STEPS),
           "--epochs", "1", "--log-every", "2", "--out", str(out), "--data-root", str(ctx.work / "digits")]
    proc, seconds = _run(cmd, timeout)
    text = proc.stdout or ""
    acc = re.search(r"final val_acc ([\d.]+)", text)
    ok = proc.returncode == 0 and acc is not None and (out / "export" / "model.safetensors").is_file()
    return Row(CHECK, f"vit2b.py, vit_tiny config, disttrain_fsdp, 1 {ctx.device.type} device",
               f"{STEPS} steps in {seconds:.0f} s (process included); val_acc {acc.group(1)}; checkpoint and timm "
               f"export written" if ok else "-", "runs, trains, validates, exports", ok, "" if ok else _failure(proc),
               details={"stdout_tail": text[-1500:]})


def deepfm(ctx: Context, timeout: float) -> Row:
    item = f"deepfm_daily.py, deepfm_tiny config, disttrain_recsys, 1 {ctx.device.type} device"
    target = "trains one day, evaluates, publishes"
    missing = optional_import("torchrec") or (None if ctx.dry else optional_import("fbgemm_gpu"))
    if missing:
        return skipped(CHECK, item, target, f"torchrec cannot be imported here ({missing}); its kernels, fbgemm-gpu, "
                       "are a 498 MB CUDA wheel built for torch 2.14 (over the 64 MiB a call carries, and not for "
                       "this machine's torch)")
    from disttrain.recsys.synthetic import make_days

    data, models = ctx.work / "clicks", ctx.work / "deepfm"
    make_days(data, days=1, rows_per_day=4000 if ctx.dry else 50000)
    cmd = [sys.executable, "recipes/recsys/deepfm_daily.py", "--data-root", str(data), "--model-root", str(models),
           "--accelerator", _accelerator(ctx)]
    proc, seconds = _run(cmd, timeout)
    records = sorted((models / "runs").glob("*.json")) if (models / "runs").is_dir() else []
    record = json.loads(records[-1].read_text()) if records else {}
    ok = proc.returncode in (0, 3) and record.get("status") in ("published", "rejected")
    return Row(CHECK, item, f"status {record.get('status')} in {seconds:.0f} s (process included); "
                            f"metrics {json.dumps(record.get('metrics', {}))[:200]}" if ok else "-", target, ok,
               "" if ok else _failure(proc), details={"record": record})


def run(ctx: Context) -> Iterator[Row]:
    timeout = 300.0 if ctx.dry else 100.0
    for name, part in (("dialogue_llm.py", dialogue), ("vit2b.py", vit), ("deepfm_daily.py", deepfm)):
        yield from guarded(CHECK, name, "runs", lambda: part(ctx, timeout))
