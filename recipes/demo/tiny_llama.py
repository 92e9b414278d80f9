"""`make demo`: train a small Llama (transformers) with disttrain_fsdp on 2 CPU processes.

    lightning run model recipes/demo/tiny_llama.py --accelerator cpu --devices 2 --strategy disttrain_fsdp
    python recipes/demo/tiny_llama.py            # same defaults; launches its own processes

The data is a tiny synthetic language: each sequence counts from a random start with a random stride
(token[t+1] = token[t] + stride mod V). The first two tokens fix the stride, so held-out loss falls quickly
when the model learns the rule. Shows: a progress bar, the loss falling, per-rank parameter memory against the
unsharded size, and steps/s; TensorBoard and CSV logs under --out/logs (--logger) and the run report
--out/report.png + report.md at the end. The bar is drawn only in a terminal (logs get the evaluation lines).
"""

from __future__ import annotations

import argparse
import logging
import math
import time

import lightning as L
import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import LlamaConfig, LlamaForCausalLM

import disttrain  # noqa: F401  (registers disttrain_* names)
from disttrain.fabric import builds_empty
from disttrain.launch import build_strategy, fabric_kwargs, launched
from disttrain.parallel import rank_state_bytes
from disttrain.parallel import unsharded_param_bytes
from disttrain.report import fabric_loggers, interactive, start_run, write_report, write_run_info

logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # a torchao deprecation notice per process


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--out", default="runs/demo", help="the run folder: logs and report")
    p.add_argument("--logger", default="tensorboard,csv", help="tensorboard,csv | csv | tensorboard | none")
    return p.parse_args()


def counting_batch(n: int, seq_len: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, vocab, (n, 1), generator=generator)
    stride = torch.randint(1, 5, (n, 1), generator=generator)
    return (start + stride * torch.arange(seq_len)).remainder(vocab)  # (B, T)


def setup(args: argparse.Namespace) -> tuple[L.Fabric, dict]:
    # Under `lightning run model` the launcher's strategy and devices; with plain python these.
    strategy = build_strategy("disttrain_fsdp")
    fabric = L.Fabric(**fabric_kwargs(strategy, accelerator="cpu", devices=2,
                                      loggers=fabric_loggers(args.out, args.logger)))
    if not launched():
        fabric.launch()
    fabric.seed_everything(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len,
                         use_cache=False, tie_word_embeddings=False)
    with fabric.init_module(empty_init=builds_empty(fabric.strategy)):  # meta device under disttrain_fsdp: shards only
        model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    return fabric, state


def validate(fabric: L.Fabric, state: dict, args: argparse.Namespace) -> float:
    """Held-out loss: a fixed set of sequences no training step sees (different seed)."""
    model = state["model"]
    model.eval()
    g = torch.Generator().manual_seed(10_000 + fabric.global_rank)
    with torch.no_grad():
        ids = fabric.to_device(counting_batch(32, args.seq_len, args.vocab, g))
        loss = model(input_ids=ids, labels=ids).loss
    model.train()
    return fabric.all_reduce(loss, reduce_op="mean").item()


def fit(fabric: L.Fabric, state: dict, args: argparse.Namespace) -> None:
    model, optimizer = state["model"], state["optimizer"]
    g = torch.Generator().manual_seed(fabric.global_rank)  # each rank draws its own data
    progress = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[rate]:.1f} steps/s"),
                        TimeRemainingColumn(), console=Console(),
                        disable=not (fabric.is_global_zero and interactive()))
    start = time.perf_counter()
    with progress:
        task = progress.add_task("train", total=args.steps, loss=float("nan"), rate=0.0)
        for step in range(1, args.steps + 1):
            ids = fabric.to_device(counting_batch(args.micro_batch, args.seq_len, args.vocab, g))
            loss = model(input_ids=ids, labels=ids).loss
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            state["step"] = step
            rate = step / (time.perf_counter() - start)
            progress.update(task, advance=1, loss=loss.item(), rate=rate)
            fabric.log_dict({"train/loss": loss.item(), "train/lr": args.lr, "throughput/tokens_per_s":
                             ids.numel() * fabric.world_size * rate, "time/elapsed_s": time.perf_counter() - start},
                            step=step)
            if step % args.eval_every == 0 or step == args.steps:
                held_out = validate(fabric, state, args)  # every rank takes part
                fabric.log_dict({"val/loss": held_out, "val/ppl": math.exp(held_out)}, step=step)
                if fabric.is_global_zero:
                    progress.console.print(f"step {step:3d}  train loss {loss.item():.3f}  "
                                           f"held-out loss {held_out:.3f}  {rate:.1f} steps/s")
    state["steps_per_s"] = args.steps / (time.perf_counter() - start)


def report_memory(fabric: L.Fabric, state: dict) -> None:
    model = state["model"]
    local = rank_state_bytes(model)["params"]
    per_rank = [0] * fabric.world_size
    dist.all_gather_object(per_rank, local) if dist.is_initialized() else per_rank.__setitem__(0, local)
    full = unsharded_param_bytes(model)
    if fabric.is_global_zero:
        for rank, size in enumerate(per_rank):
            print(f"rank {rank}: parameters {size / 2**20:.2f} MiB of {full / 2**20:.2f} MiB unsharded "
                  f"({size / full:.1%}; ideal 1/{fabric.world_size} = {1 / fabric.world_size:.1%})")


def main() -> None:
    args = parse_args()
    fabric, state = setup(args)
    n_params = sum(p.numel() for p in state["model"].parameters())
    fabric.print(f"{type(fabric.strategy).__name__} on {fabric.world_size} x {fabric.device.type}: "
                 f"Llama with {n_params / 1e6:.2f}M parameters, chance loss {math.log(args.vocab):.3f}")
    report_memory(fabric, state)
    fabric.print(f"held-out loss before training {validate(fabric, state, args):.3f}")
    if fabric.is_global_zero:
        start_run(args.out, recipe="recipes/demo/tiny_llama.py", strategy=fabric.strategy,
                  world_size=fabric.world_size, device=fabric.device.type,
                  precision=str(fabric.strategy.precision.precision))
    start = time.perf_counter()
    fit(fabric, state, args)
    fabric.print(f"done: {state['step']} steps at {state['steps_per_s']:.1f} steps/s")
    log_memory(fabric, state["step"])
    if fabric.is_global_zero:
        finish_run(fabric, args, time.perf_counter() - start)


def log_memory(fabric: L.Fabric, step: int) -> None:
    """Every rank's peak memory to the loggers (the report's per-rank bars)."""
    from disttrain.callbacks.throughput import peak_memory_mib

    peaks = fabric.all_gather(torch.tensor([peak_memory_mib(fabric.device)])).reshape(-1).tolist()
    fabric.log_dict({f"memory/peak_mib_rank{r}": m for r, m in enumerate(peaks)}, step=step)


def finish_run(fabric: L.Fabric, args: argparse.Namespace, wall_s: float) -> None:
    """Rank 0: close the loggers, record the wall time, draw the run report (from the CSV logs)."""
    for logger in fabric.loggers:
        logger.finalize("success")
    write_run_info(args.out, finished=True, wall_s=round(wall_s, 2))
    if "csv" in args.logger:
        png, md = write_report(args.out)
        print(f"report: {png} and {md}")


if __name__ == "__main__":
    main()
