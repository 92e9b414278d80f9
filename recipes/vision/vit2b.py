"""Train a timm ViT classifier with Lightning Fabric: the ~2B ViT on GPUs, the tiny config on CPU.

    python recipes/vision/vit2b.py                   # starts its own processes: one per GPU, or 2 on CPU
    lightning run model recipes/vision/vit2b.py      # 1 process: the launcher's --devices defaults to 1
    lightning run model recipes/vision/vit2b.py --accelerator cpu --devices 2 --strategy disttrain_fsdp
    lightning run model recipes/vision/vit2b.py --accelerator gpu --devices 8 --strategy disttrain_megatron
    lightning run model recipes/vision/vit2b.py --accelerator cpu --devices 2 --strategy disttrain_megatron \
        --pipeline-parallel-size 2     # two pipeline stages instead of the default head split
    python recipes/vision/vit2b.py --config configs/vision/vit_tiny.yaml      # launches its own processes
    python recipes/vision/vit2b.py --config configs/vision/vit_tiny.yaml --pretrained PATH   # fine-tunes a timm ViT

Defaults: the largest configs/vision/vit*.yaml whose training state fits this machine's devices (the tiny config
on CPU; the planner decides what fits), and the set-up of the 2B ViT reference case (16 GPUs),
head-split tensor parallel (tp=2) x data parallel (``disttrain_megatron``), on an even number of CUDA devices;
``disttrain_fsdp`` otherwise. ``--strategy`` overrides it with any registered name.

Writes under --out: ``ckpt`` (a resumable checkpoint, replaced atomically at epoch ends; ``--resume OUT/ckpt``
continues from the next epoch, so a run stopped by --steps counts its last epoch as done), with ``--save-every N``
also ``checkpoints/step-NNNNNN`` every N optimizer steps (a resume continues inside its epoch), and ``export``
(model.safetensors + config.json: ``timm.create_model("local-dir:OUT/export", pretrained=True)``), ``logs``
(TensorBoard and CSV, ``--logger``) and ``report.png`` + ``report.md`` at the end (``disttrain report OUT``).
A progress bar follows training on rank 0 in a terminal; logs get plain periodic lines.

``--pretrained PATH`` starts from a timm checkpoint of the config's architecture (``disttrain.vision.pretrained``):
each process reads only its own slices of its safetensors into its shards; a new class count re-initialises the head.

The flags every recipe shares (strategy, devices, parallel sizes, steps, batch, checkpoints: disttrain.launch) are
listed together by --help, with their defaults; ``--max-steps`` and ``--batch-size`` are the older names of
``--steps`` and ``--micro-batch``. ``--global-batch N`` accumulates gradients over micro-steps up to N images per
optimizer step.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

import disttrain  # noqa: F401  (registers the disttrain_* names)
from disttrain.callbacks import GradientAccumulation, Throughput
from disttrain.callbacks.accumulation import data_parallel_ranks
from disttrain.fabric import builds_empty, use_async_checkpoint, wait_checkpoint
from disttrain.launch import Default, add_recipe_flags, build_strategy, fabric_kwargs, flag_names, launched, \
    launcher_setting, strategy_name, strategy_options, world_size
from disttrain.parallel.guards import watchdog
from disttrain.parallel.guards.failures import one_line_failures
from disttrain.report import StepProgress, fabric_loggers, start_run, write_report, write_run_info
from disttrain.vision import (ImageFolderData, SkippingSampler, ViTClassifier, count_parameters, default_config,
                              default_strategy, export_timm, load_timm_checkpoint, read_yaml, timm_checkpoint)
from disttrain.vision.defaults import cuda_memory, reference_options
from disttrain.vision.export import PREFIX

logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # a torchao deprecation notice per process


# Where the shared flags' defaults come from in this recipe (disttrain.launch.add_recipe_flags).
FLAG_DEFAULTS = {
    "strategy": Default(None, "the 2B reference case's set-up on an even number of CUDA devices, head-split tensor"
                              " parallel (tp=2) x data parallel; disttrain_fsdp otherwise"),
    "accelerator": "auto", "devices": Default(None, "every GPU, or 2 CPU processes"), "num_nodes": 1,
    "precision": Default.config("train.precision"),
    "tensor_parallel_size": Default(None, "2, the 2B reference case's head-split TP, under a strategy that takes it"
                                          " on an even number of processes when no other parallel size is given;"
                                          " else 1"),
    "pipeline_parallel_size": Default(None, "1"),
    "steps": Default.config("train.max_steps", "none: every epoch of train.epochs"),
    "micro_batch": Default.config("data.batch_size"),
    "global_batch": Default.config("train.global_batch_size", "none: micro batch x data-parallel ranks"),
    "lr": Default.config("train.lr"), "activation_checkpointing": Default.config("train.activation_checkpointing"),
    "resume": Default(None, "none: a fresh start"), "out": "runs/vit",
    "save_every": Default(0, "0: at epoch ends only, in --out/ckpt (train.checkpoint_every_epochs)"),
    "async_checkpoint": Default.config("train.async_checkpoint"),
}
SPLIT_INSTEAD = "split the model with --tensor-parallel-size or --pipeline-parallel-size"
DOES_NOT_APPLY = {
    "seq_len": "a ViT's sequence is its patches, (img_size / patch_size)^2 tokens: set model.img_size and"
               " model.patch_size in the config",
    "context_parallel_size": "context parallelism splits the long token sequences of HF Llama-family language"
                             f" models, and a ViT's sequence is its few patches; {SPLIT_INSTEAD}",
    "expert_parallel_size": f"expert parallelism splits an MoE model's experts, and a ViT has none; {SPLIT_INSTEAD}",
}
# The recipe's older flag names, still accepted.
ALIASES = {"steps": ["--max-steps"], "micro_batch": ["--batch-size"]}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="a configs/vision/*.yaml (default: the largest that fits)")
    p.add_argument("--data-root", default=None,
                   help="ImageFolder tree with train/ and val/ (default: the config's data.root)")
    p.add_argument("--epochs", type=int, default=None, metavar="N",
                   help="passes over the training set (default: the config's train.epochs)")
    p.add_argument("--log-every", type=int, default=20, metavar="N",
                   help="log the training loss every N steps (default: 20)")
    p.add_argument("--logger", default="tensorboard,csv",
                   help="tensorboard,csv | csv | tensorboard | none (default: tensorboard,csv)")
    p.add_argument("--no-report", action="store_true", help="do not draw --out/report.png at the end")
    p.add_argument("--pretrained", default=None,
                   help="a local timm checkpoint to fine-tune, of the config's architecture: a folder (config.json +"
                        " model.safetensors, as timm saves for the hub) or a .safetensors file, read sharded (each"
                        " process only its own slices); a .pth/.bin state dict is read whole once per machine. A"
                        " checkpoint with another class count leaves the head freshly initialised. Ignored with"
                        " --resume (the checkpoint holds the fine-tuned weights)")
    add_recipe_flags(p, FLAG_DEFAULTS, DOES_NOT_APPLY, ALIASES)
    return p.parse_args(argv)


def processes(args: argparse.Namespace, cuda: bool) -> tuple[int, int]:
    """(processes per node, processes in all): the launcher's (torchrun's variables) when it started them, else
    --devices (every GPU, or 2 on CPU) x --num-nodes."""
    if "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        return int(os.environ.get("LOCAL_WORLD_SIZE", world)), world
    per_node = args.devices or (torch.cuda.device_count() if cuda else 2)
    return per_node, world_size(per_node, args.num_nodes)


def make_fabric(args: argparse.Namespace, vit: ViTClassifier, config_path: Path, accelerator: str, per_node: int,
                world: int) -> L.Fabric:
    """Fabric with the launcher's settings; what the launcher left open comes from the args and the defaults."""
    given = strategy_options(args)
    if strategy_name(args.strategy) == "auto" and args.strategy is None:  # nobody named one: the reference set-up
        name, options = default_strategy(per_node, accelerator)
    else:
        name = strategy_name(args.strategy)
        options = reference_options(name, given, world)
    strategy = build_strategy(name, {**options, **given}, model=str(config_path), world=world, flags=flag_names(),
                              planner={"micro_batch": vit.data_config.batch_size})
    return L.Fabric(**fabric_kwargs(strategy, accelerator=args.accelerator, devices=per_node,
                                    num_nodes=args.num_nodes, precision=vit.train_config.precision,
                                    loggers=fabric_loggers(args.out, args.logger)))


def setup(args: argparse.Namespace) -> tuple[L.Fabric, dict, dict]:
    """Fabric, the sharded model, optimizer and schedule (``state``, what a checkpoint holds) and the data."""
    accelerator = launcher_setting("accelerator") or args.accelerator
    cuda = accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available()
    per_node, world = processes(args, cuda)
    config_path = Path(args.config) if args.config else \
        default_config(world, cuda_memory() if cuda else None, args.micro_batch)
    config = read_yaml(config_path)
    vit = ViTClassifier.from_config(config_path, root=args.data_root, batch_size=args.micro_batch)
    for key, value in (("epochs", args.epochs), ("max_steps", args.steps), ("lr", args.lr),
                       ("precision", args.precision), ("activation_checkpointing", args.activation_checkpointing),
                       ("async_checkpoint", args.async_checkpoint), ("global_batch_size", args.global_batch)):
        if value is not None:
            setattr(vit.train_config, key, value)
    # Checked against the config before any process starts or any weight is built (safetensors headers only).
    pretrained = timm_checkpoint(args.pretrained, vit.model_args, str(config_path)) \
        if args.pretrained and not args.resume else None

    fabric = make_fabric(args, vit, config_path, accelerator, per_node, world)
    if vit.train_config.async_checkpoint:
        use_async_checkpoint(fabric.strategy, "--async-checkpoint (train.async_checkpoint)")
    micro = vit.data_config.batch_size
    accumulation = GradientAccumulation(global_batch_size=vit.train_config.global_batch_size
                                        or micro * data_parallel_ranks(fabric.strategy, fabric.world_size))
    accumulation.attach(fabric, micro)  # before launch: feeds disttrain_zero3's DeepSpeed config
    if not launched():
        fabric.launch()  # only with plain `python`: the launcher already started every process
    fabric.seed_everything(vit.train_config.seed)
    fabric.print(f"{config_path}: ViT with {count_parameters(config['model']) / 1e6:,.1f}M parameters,"
                 f" {type(fabric.strategy).__name__} on {fabric.world_size} x {fabric.device.type};"
                 f" {accumulation.steps} micro-step(s) of {micro} images per optimizer step")

    data = ImageFolderData(vit.data_config, img_size=_side(vit.model_args), num_classes=vit.num_classes)
    with fabric.rank_zero_first(local=True):  # one process per machine writes the demo tree
        data.prepare_data()
    data.setup()
    loaders = make_loaders(fabric, data)

    with fabric.init_module(empty_init=builds_empty(fabric.strategy)):  # meta device (FSDP) / zero.Init (ZeRO-3): only shards allocated
        vit.configure_model()
    per_epoch = len(loaders["train"]) // accumulation.steps
    if per_epoch == 0:
        raise SystemExit(f"vit2b: error: {len(loaders['train'])} batches per epoch on this rank make no optimizer step"
                         f" of {accumulation.steps} micro-steps; lower --global-batch or --micro-batch")
    vit.total_steps = min(vit.train_config.epochs * per_epoch, vit.train_config.max_steps or 10**12)
    optim = vit.configure_optimizers()
    model, optimizer = fabric.setup(vit, optim["optimizer"])
    state = {"model": model, "optimizer": optimizer, "scheduler": optim["lr_scheduler"]["scheduler"],
             "step": 0, "epoch": 0}
    if pretrained is not None:  # after setup: under disttrain strategies each process reads its own slices only
        load_timm_checkpoint(fabric, model, pretrained)
        fabric.print(f"fine-tuning {pretrained.path}")
        if pretrained.note:
            fabric.print(pretrained.note)
    if args.resume:
        fabric.load(args.resume, state)
        fabric.print(f"resumed from {args.resume} at epoch {state['epoch']}, step {state['step']}")
    return fabric, state, {"vit": vit, "classes": data.classes, "accumulation": accumulation,
                           "per_epoch": per_epoch, "save_every": args.save_every, **loaders}


def _side(model_args: dict) -> int:
    size = model_args.get("img_size", 224)
    return size if isinstance(size, int) else int(size[0])


def make_loaders(fabric: L.Fabric, data: ImageFolderData) -> dict[str, Any]:
    """Loaders over this rank's share of the data-parallel ranks (tensor-parallel peers read the same batches);
    the training sampler's epoch is set by fit(), so a resumed run sees the order it would have seen."""
    shard = getattr(fabric.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    train, val = data.train_dataloader(), data.val_dataloader()
    train_sampler = SkippingSampler(train.dataset, shuffle=True, drop_last=True, seed=0, **shard)
    val_sampler = DistributedSampler(val.dataset, shuffle=False, **shard)
    common = dict(num_workers=train.num_workers, persistent_workers=train.num_workers > 0)
    return {"train": DataLoader(train.dataset, batch_size=train.batch_size, sampler=train_sampler, drop_last=True,
                                **common),
            "val": DataLoader(val.dataset, batch_size=val.batch_size, sampler=val_sampler, **common)}


def fit(fabric: L.Fabric, state: dict, run: dict, out: Path, log_every: int) -> dict[str, float]:
    cfg = run["vit"].train_config
    metrics: dict[str, float] = {}
    start = time.perf_counter()
    total = min(cfg.epochs * run["per_epoch"], cfg.max_steps or 10**12)
    # images/s and per-rank memory at the log steps; FLOPs of the timm model are not counted here, so no MFU
    throughput = Throughput(every_n_steps=max(2, log_every))
    with StepProgress(total=total, description="train", enabled=fabric.is_global_zero, start=state["step"]) as bar:
        for epoch in range(state["epoch"], cfg.epochs):
            epoch_metrics, last = fit_epoch(fabric, state, run, out, epoch, log_every, start, throughput, bar)
            metrics = epoch_metrics or metrics
            if last:
                break
    return metrics


def fit_epoch(fabric: L.Fabric, state: dict, run: dict, out: Path, epoch: int, log_every: int, start: float,
              throughput: Throughput, bar: StepProgress) -> tuple[dict[str, float], bool]:
    """One epoch (from where a resumed checkpoint stopped in it), then the validation and checkpoint it is due;
    returns (metrics or {}, whether training ends)."""
    model, optimizer, scheduler = state["model"], state["optimizer"], state["scheduler"]
    cfg, acc = run["vit"].train_config, run["accumulation"]
    metrics: dict[str, float] = {}
    done = max(0, state["step"] - epoch * run["per_epoch"])  # optimizer steps of this epoch before a resume
    sampler = run["train"].sampler
    sampler.set_epoch(epoch)
    sampler.skip = done * acc.steps * run["train"].batch_size
    batches = iter(run["train"])
    model.train()
    for _ in range(done, run["per_epoch"]):
        watchdog.set_step(f"training step {state['step'] + 1}")
        loss, images = torch.zeros((), device=fabric.device), 0
        for micro in range(acc.steps):
            batch = fabric.to_device(next(batches))
            # gradients are reduced on the last micro-step only
            with acc.micro_step(fabric, model, micro) if acc.steps > 1 else nullcontext():
                micro_loss = model.training_step(batch, state["step"])
                fabric.backward(acc.scale(fabric, micro_loss))
            loss += micro_loss.detach() / acc.steps
            images += batch[0].shape[0]
        optimizer.step()
        optimizer.zero_grad()
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step()
        state["step"] += 1
        throughput.step(fabric, samples=images)
        bar.update(epoch=epoch + 1, loss=round(loss.item(), 4))
        if state["step"] % log_every == 0:
            bar.print(f"epoch {epoch + 1} step {state['step']}: loss {loss.item():.4f}, {bar.rate():.2f} steps/s")
            fabric.log_dict({"train/loss": loss.item(), "train/lr": lr,
                             "time/elapsed_s": time.perf_counter() - start}, step=state["step"])
        if run["save_every"] and state["step"] % run["save_every"] == 0:
            path = out / "checkpoints" / f"step-{state['step']:06d}"
            fabric.save(path, state)  # "epoch" counts the epochs done: a resume continues inside this one
            bar.print(f"saved {path}")
        if cfg.max_steps and state["step"] >= cfg.max_steps:
            break
    state["epoch"] = epoch + 1
    last = state["epoch"] == cfg.epochs or bool(cfg.max_steps and state["step"] >= cfg.max_steps)
    if last or state["epoch"] % cfg.val_every_epochs == 0:
        metrics = validate(fabric, state, run)
        fabric.log_dict({"val/acc": metrics["val_acc"], "val/loss": metrics["val_loss"]}, step=state["step"])
        bar.print(f"epoch {state['epoch']}: val_acc {metrics['val_acc']:.4f}, val_loss {metrics['val_loss']:.4f}"
                  f" ({time.perf_counter() - start:.1f} s)")
    if last or state["epoch"] % cfg.checkpoint_every_epochs == 0:
        fabric.save(out / "ckpt", state)  # atomic: a crash mid-save keeps the previous checkpoint
    return metrics, last


@torch.no_grad()
def validate(fabric: L.Fabric, state: dict, run: dict) -> dict[str, float]:
    """Top-1 accuracy and loss on the validation set, over every rank (torchmetrics syncs the counts)."""
    model = state["model"]
    model.eval()
    for i, batch in enumerate(run["val"]):
        model.validation_step(fabric.to_device(batch), i)
    model.train()
    return run["vit"].validation_metrics()


def main() -> None:
    args = parse_args()
    wall_start = time.perf_counter()
    try:
        fabric, state, run = setup(args)
    except (FileNotFoundError, ValueError) as e:  # bad paths, config values or sizes: the message says the fix
        raise SystemExit(f"vit2b: error: {e}") from None
    out = Path(args.out)
    if fabric.is_global_zero:
        start_run(out, recipe="recipes/vision/vit2b.py", strategy=fabric.strategy, world_size=fabric.world_size,
                  device=fabric.device.type, precision=str(fabric.strategy.precision.precision),
                  config=str(args.config or "default"))
    with one_line_failures("vit2b", str(out)):  # a full disk, a stalled collective, a bad checkpoint
        if state["epoch"] >= run["vit"].train_config.epochs:
            metrics = validate(fabric, state, run)
            fabric.print(f"already trained: val_acc {metrics['val_acc']:.4f}")
        else:
            metrics = fit(fabric, state, run, out, args.log_every)
            wait_checkpoint(fabric.strategy)  # the last checkpoint written in the background is complete
        if not math.isfinite(metrics["val_loss"]):  # a diverged model is never exported
            raise SystemExit(f"held-out loss is {metrics['val_loss']}: training diverged, nothing exported to "
                             f"{out / 'export'}; lower train.lr or use precision 32-true in"
                             f" {args.config or 'the config'}")
        export = export_timm(out / "export", run["vit"].model_args,
                             lambda path: _export_weights(fabric, state["model"], path),
                             data=run["vit"].data_config, class_names=run["classes"])
    fabric.print(f"final val_acc {metrics['val_acc']:.4f}; checkpoint {out / 'ckpt'}, timm export {export}")
    if fabric.is_global_zero:
        finish_run(fabric, args, out, time.perf_counter() - wall_start)
    fabric.barrier()


def finish_run(fabric: L.Fabric, args: argparse.Namespace, out: Path, wall_s: float) -> None:
    """Rank 0 after training: close the loggers, record the wall time, draw the run report."""
    for logger in fabric.loggers:
        logger.finalize("success")
    write_run_info(out, finished=True, wall_s=round(wall_s, 2))
    if args.no_report:
        return
    if "csv" not in args.logger:
        print(f"no report: it is drawn from the CSV logs and --logger {args.logger!r} has no csv")
        return
    png, md = write_report(out)
    print(f"report: {png} and {md}")


def _export_weights(fabric: L.Fabric, model: Any, path: Path) -> Optional[Path]:
    """The strategy's full-weights export of the timm model (``self.model``) as safetensors."""
    if hasattr(fabric.strategy, "export_full"):
        return fabric.strategy.export_full(model, path, prefix=PREFIX)
    from disttrain.parallel.checkpoint.io import export_safetensors  # single-device Fabric strategies

    return export_safetensors(getattr(model, "module", model), path, prefix=PREFIX)


if __name__ == "__main__":
    main()
