"""Dialogue LLM: chat SFT of a causal LM (disttrain.nlp.DialogueLM: Llama, or the HF model_type the config names, e.g.
an MoE) with Lightning Fabric, under any disttrain strategy. Loss only on assistant turns; dialogues packed without
attending to each other.

    lightning run model recipes/nlp/dialogue_llm.py --accelerator cpu --devices 2 --strategy disttrain_fsdp
    lightning run model recipes/nlp/dialogue_llm.py --accelerator cpu --devices 2 --strategy disttrain_zero3
    lightning run model recipes/nlp/dialogue_llm.py --accelerator cpu --devices 2 --strategy disttrain_auto
    lightning run model recipes/nlp/dialogue_llm.py --accelerator cpu --devices 2 --strategy disttrain_megatron \
        --tensor-parallel-size 2      # each block's heads and MLP split over the 2 processes
    lightning run model recipes/nlp/dialogue_llm.py --accelerator cpu --devices 2 --strategy disttrain_megatron \
        --context-parallel-size 2     # each packed row split over the 2 processes (long dialogues)
    lightning run model recipes/nlp/dialogue_llm.py --accelerator cpu --devices 2 --strategy disttrain_megatron \
        --config configs/nlp/dialogue_moe_tiny.yaml --expert-parallel-size 2   # MoE: experts split over 2 processes
    python recipes/nlp/dialogue_llm.py        # same defaults (tiny config, 2 CPU processes, disttrain_fsdp)
    python recipes/nlp/dialogue_llm.py --accelerator gpu --devices 1 --config configs/nlp/dialogue_1b.yaml \
        --data chats.jsonl --tokenizer /models/my-tokenizer

Without --data/--tokenizer it trains on the chatterbot-corpus dialogues (English and Chinese), converted to JSONL
with a BPE tokenizer trained on them, under data/dialogue/ on first use. Prints held-out loss and perplexity and
tokens/s as it trains, exports a Hugging Face folder (--out/hf: config + safetensors + tokenizer) and prints the
exported model's greedy reply to a sample prompt. A progress bar (rank 0, in a terminal; plain periodic lines in logs)
follows training; TensorBoard and CSV logs go under --out/logs (--logger), and --out/report.png + report.md sum the
run up at the end (`disttrain report OUT`, OUT being the --out folder, redraws them, also for an interrupted run).
--save-every N writes resumable checkpoints (model, optimizer, schedule and the data position) under
--out/checkpoints (--async-checkpoint or train.async_checkpoint: written in the background while training goes on);
--resume PATH continues with the next unseen batch.

The flags every recipe shares (strategy, devices, parallel sizes, steps, batch, checkpoints: disttrain.launch) are
listed together by --help, with their defaults: the config's values where it has them. Under `lightning run model`
the launcher's --strategy, --devices, --accelerator and --precision are the ones used.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from safetensors.torch import load_file
from transformers.initialization import no_init_weights

import disttrain  # noqa: F401  (registers the disttrain_* names)
from disttrain.callbacks import GradientAccumulation, Throughput, apply_fast_attention
from disttrain.fabric import builds_empty, use_async_checkpoint, wait_checkpoint
from disttrain.launch import Default, add_recipe_flags, build_strategy, fabric_kwargs, flag_names, launched, \
    strategy_options, world_size
from disttrain.nlp import DataError, DialogueLM, ResumableSampler, build_datasets, export_hf, load_tokenizer, \
    read_jsonl, read_recipe_config, reply_from_export
from disttrain.nlp.corpus import DEFAULT_DEMO_ROOT, demo_data
from disttrain.nlp.data import HeldOutRows, collate
from disttrain.nlp.module import lr_factor
from disttrain.nlp.replies import Sampling, sample_replies, side_by_side
from disttrain.parallel.checkpoint.io import export_safetensors, write_safetensors
from disttrain.parallel.guards import watchdog
from disttrain.parallel.guards.failures import one_line_failures
from disttrain.parallel.split.lora import LoraSettings, adapter_layers, split_export, trainable_summary, write_adapter
from disttrain.report import StepProgress, fabric_loggers, start_run, write_report, write_run_info

logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # a torchao deprecation notice per process
warnings.filterwarnings("ignore", message=".*all_gather is deprecated")  # Lightning's all_gather, once per rank
ROOT = Path(__file__).resolve().parents[2]


# Where the shared flags' defaults come from in this recipe (disttrain.launch.add_recipe_flags).
FLAG_DEFAULTS = {
    "strategy": "disttrain_fsdp", "accelerator": "cpu", "devices": 2, "num_nodes": 1,
    "precision": Default.config("train.precision"),
    "tensor_parallel_size": Default(None, "1"), "context_parallel_size": Default(None, "1"),
    "expert_parallel_size": Default(None, "1"),
    "seq_len": Default.config("data.seq_len"), "steps": Default.config("train.steps"),
    "micro_batch": Default.config("train.micro_batch_size"),
    "global_batch": Default.config("train.global_batch_size", "none: micro batch x data-parallel ranks"),
    "lr": Default.config("train.lr"), "activation_checkpointing": Default.config("train.activation_checkpointing"),
    "resume": Default(None, "none: a fresh start"), "out": "runs/dialogue_llm", "save_every": Default(0, "0: none"),
    "async_checkpoint": Default.config("train.async_checkpoint"),
}
DOES_NOT_APPLY = {
    "pipeline_parallel_size": "pipeline stages run full, unpadded sequences of one dialogue, and this recipe packs"
                              " several dialogues into each row; split the model with --tensor-parallel-size,"
                              " --context-parallel-size or --expert-parallel-size, or shard it with disttrain_fsdp or"
                              " disttrain_zero3",
}


DEMO_CONFIG = ROOT / "configs/nlp/dialogue_tiny.yaml"
# Fine-tuning a --pretrained model without a --config: the usual starting points (full fine-tuning of 7B-class chat
# models at 1e-5..5e-5, LoRA at 1e-4..3e-4), and rows no longer than this unless the flags ask.
FINE_TUNING_LR = {"full": 2e-5, "lora": 2e-4}
FINE_TUNING_SEQ_CAP = 4096


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="recipe YAML (default: configs/nlp/dialogue_tiny.yaml, the demo's; with --pretrained its"
                        " precision, sequence length and learning rate give way to the fine-tuning defaults)")
    p.add_argument("--data", default=None,
                   help="chat JSONL (default: the config's data.train, else the demo); 'demo': the chatterbot demo"
                        " dialogues. Required with --pretrained unless the config names data.train")
    p.add_argument("--tokenizer", default=None, help="local HF tokenizer folder (default: config, else demo)")
    p.add_argument("--pretrained", default=None,
                   help="local HF causal-LM folder to fine-tune (config.json + *.safetensors; any family): its config"
                        " replaces the YAML's model:, its tokenizer and chat template are used when it has one, and"
                        " each process reads only its own slices of the weights. Without --config, what the flags"
                        " leave open follows the model and the device: precision bf16-mixed on a GPU with bfloat16"
                        " (16-mixed on older GPUs, 32-true on CPU), sequence length the model's longest up to"
                        f" {FINE_TUNING_SEQ_CAP}, learning rate {FINE_TUNING_LR['full']:g}"
                        f" ({FINE_TUNING_LR['lora']:g} with LoRA)")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="train LoRA adapters of this rank on the frozen --pretrained model (overrides lora.rank; 0: the"
                        " whole model trains); the run exports the adapter folder --out/adapter (peft's format)")
    p.add_argument("--merge", action="store_true",
                   help="with LoRA: export the merged model (--out/hf, a plain HF folder) instead of the adapter"
                        " folder")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed JSONL lines")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="held-out loss every N steps (default: train.eval_every)")
    p.add_argument("--logger", default="tensorboard,csv",
                   help="tensorboard,csv | csv | tensorboard | none (default: tensorboard,csv)")
    p.add_argument("--no-report", action="store_true", help="do not draw --out/report.png at the end")
    p.add_argument("--log-every", type=int, default=0, metavar="N",
                   help="print the train loss every N steps (default: 0, at evals)")
    p.add_argument("--prompt", default=None, help="sample prompt answered after training (default: train.prompt)")
    p.add_argument("--demo-root", default=str(ROOT / DEFAULT_DEMO_ROOT),
                   help=f"where the demo data is built (default: {DEFAULT_DEMO_ROOT})")
    add_recipe_flags(p, FLAG_DEFAULTS, DOES_NOT_APPLY)
    args = p.parse_args(argv)
    args.config_given = args.config is not None
    args.config = args.config or str(DEMO_CONFIG)
    return args


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The config's sections with the command line's overrides applied."""
    config = read_recipe_config(args.config)
    train = dict(config.get("train", {}))
    for key, value in (("steps", args.steps), ("eval_every", args.eval_every), ("micro_batch_size", args.micro_batch),
                       ("global_batch_size", args.global_batch), ("lr", args.lr), ("prompt", args.prompt),
                       ("precision", args.precision), ("async_checkpoint", args.async_checkpoint),
                       ("activation_checkpointing", args.activation_checkpointing)):
        if value is not None:
            train[key] = value
    data = dict(config.get("data", {}))
    if args.seq_len is not None:
        data["seq_len"] = args.seq_len
    demo_chosen = args.data == "demo"
    data["train"] = None if demo_chosen else (args.data or data.get("train"))
    data["tokenizer"] = args.tokenizer or data.get("tokenizer")
    model = config["model"]
    lora = dict(config.get("lora") or {})
    if args.lora_rank is not None:
        lora["rank"] = args.lora_rank
    lora_settings = LoraSettings.from_dict(lora, where=f"{args.config}: lora")
    if lora_settings.enabled and not args.pretrained:
        raise ValueError(f"LoRA (rank {lora_settings.rank}) adapts pretrained weights: pass --pretrained DIR (a local"
                         " HF folder), or --lora-rank 0 to train the whole model")
    if args.merge and not lora_settings.enabled:
        raise ValueError("--merge merges LoRA adapters into the model: pass --lora-rank N (or a lora: section) with it")
    if args.pretrained:
        from transformers import AutoConfig

        from disttrain.parallel.checkpoint.pretrained import check_pretrained

        folder = check_pretrained(args.pretrained)
        model = AutoConfig.from_pretrained(str(folder)).to_dict()
        if not args.tokenizer and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            data["tokenizer"] = str(folder)
        if not data["train"] and not demo_chosen:
            raise ValueError(f"--pretrained {args.pretrained} fine-tunes a real model on your chats: pass --data"
                             " CHATS.jsonl (one dialogue per line, as docs/recipes/dialogue-llm.md shows), or --data"
                             " demo to fine-tune it on the chatterbot demo dialogues")
    chosen = []  # what the header line says was chosen for the user
    if args.pretrained and not args.config_given:
        chosen = fine_tuning_defaults(args, model, lora_settings.enabled, data, train)
    if demo_chosen:
        chosen.insert(0, "data: the chatterbot demo dialogues (--data demo)")
    return {"model": model, "data": data, "train": train, "lora": lora_settings, "chosen": chosen}


def fine_tuning_defaults(args: argparse.Namespace, model: dict[str, Any], lora: bool, data: dict[str, Any],
                         train: dict[str, Any]) -> list[str]:
    """A --pretrained model without a --config: precision from the device, sequence length from the model and a
    fine-tuning learning rate, wherever the flags leave them open (the demo YAML's are for its tiny model).
    Returns what was chosen, with the flag that changes each, for the header line."""
    chosen = []
    if args.precision is None:
        gpu = args.accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available()
        train["precision"] = ("bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed") if gpu else "32-true"
        device = "a GPU with bfloat16" if train["precision"] == "bf16-mixed" else "this GPU" if gpu else "CPU"
        chosen.append(f"precision {train['precision']} ({device}; --precision)")
    if args.seq_len is None:
        longest = int(model.get("max_position_embeddings") or FINE_TUNING_SEQ_CAP)
        data["seq_len"] = min(longest, FINE_TUNING_SEQ_CAP)
        cap = "" if longest <= FINE_TUNING_SEQ_CAP else f", capped at {FINE_TUNING_SEQ_CAP}"
        chosen.append(f"seq len {data['seq_len']} (the model's longest is {longest}{cap}; --seq-len)")
    if args.lr is None:
        train["lr"] = FINE_TUNING_LR["lora" if lora else "full"]
        chosen.append(f"lr {train['lr']:g} ({'LoRA' if lora else 'full'} fine-tuning; --lr)")
    return chosen


def setup(args: argparse.Namespace) -> tuple[L.Fabric, dict[str, Any], dict[str, Any]]:
    cfg = settings(args)
    train = cfg["train"]
    micro = int(train.get("micro_batch_size", 8))
    # The parallel sizes are checked against the strategy and the processes here, before any process starts.
    strategy = build_strategy(args.strategy, strategy_options(args), model=cfg["model"], flags=flag_names(),
                              world=world_size(args.devices, args.num_nodes),
                              planner={"micro_batch": micro, "seq_len": cfg["data"].get("seq_len"),
                                       "activation_checkpointing": train.get("activation_checkpointing") or None})
    fabric = L.Fabric(**fabric_kwargs(strategy, accelerator=args.accelerator, devices=args.devices,
                                      num_nodes=args.num_nodes, precision=train.get("precision", "32-true"),
                                      loggers=fabric_loggers(args.out, args.logger)))
    if train.get("async_checkpoint"):
        use_async_checkpoint(fabric.strategy, "--async-checkpoint (train.async_checkpoint)")
    dp = _sampler_kwargs(fabric)["num_replicas"]
    accumulation = GradientAccumulation(global_batch_size=int(train.get("global_batch_size") or micro * dp))
    accumulation.attach(fabric, micro)  # before launch: feeds disttrain_zero3's DeepSpeed config
    if not launched():
        fabric.launch()
    fabric.seed_everything(int(cfg["data"].get("seed", 0)))

    data = cfg["data"]
    with fabric.rank_zero_first():  # rank 0 builds the demo data once; the others then read it
        if not data["train"] or not data["tokenizer"]:
            jsonl, tok_dir = demo_data(args.demo_root, vocab_size=int(cfg["model"]["vocab_size"]),
                                       topics=data.get("demo_topics"))
            data["train"], data["tokenizer"] = data["train"] or str(jsonl), data["tokenizer"] or str(tok_dir)
    tokenizer = load_tokenizer(data["tokenizer"])
    dialogues, bad = read_jsonl(data["train"], skip_bad_lines=args.skip_bad_lines)
    seq_len = int(data.get("seq_len", 256))
    train_set, val_set, stats = build_datasets(tokenizer, dialogues, seq_len, float(data.get("val_fraction", 0.05)),
                                               int(data.get("seed", 0)))
    if len(tokenizer) > int(cfg["model"]["vocab_size"]):
        raise DataError(f"the tokenizer has {len(tokenizer)} tokens but model.vocab_size is "
                        f"{cfg['model']['vocab_size']}; set model.vocab_size >= {len(tokenizer)} in {args.config}")

    steps = int(train.get("steps", 40))
    module = DialogueLM(config={"model": cfg["model"]}, lr=float(train.get("lr", 3e-4)),
                        weight_decay=float(train.get("weight_decay", 0.0)),
                        warmup_steps=int(train.get("warmup_steps", 0)), max_steps=steps,
                        lora=cfg["lora"].as_dict() if cfg["lora"].enabled else None)
    lora: LoraSettings = cfg["lora"]
    # Meta device / zero.Init: shards only, for any model size. A --pretrained folder fills every weight after set-up,
    # so none is initialised here (under zero.Init that would gather each module whole in turn).
    with fabric.init_module(empty_init=builds_empty(fabric.strategy)), \
            no_init_weights() if args.pretrained else contextlib.nullcontext():
        module.configure_model()
    if train.get("activation_checkpointing"):  # the model's own, so every strategy recomputes the same blocks
        module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    attention = apply_fast_attention(module, device=fabric.device)
    # The schedule is applied by hand each step (set_lr): DeepSpeed's ZeRO-3 optimizer regroups the parameters, so
    # a torch LR scheduler bound to the optimizer before setup would no longer match its param groups.
    optimizer = module.configure_optimizers()["optimizer"]
    model, optimizer = fabric.setup(module, optimizer)
    if args.pretrained:  # the model was built empty: each process reads its own slices of the weights into its shards
        if not hasattr(fabric.strategy, "load_pretrained"):
            raise ValueError(f"--pretrained needs a disttrain strategy (disttrain_fsdp, disttrain_zero3, ...), not"
                             f" {type(fabric.strategy).__name__}")
        module.load_pretrained(args.pretrained, lambda folder, partial: fabric.strategy.load_pretrained(
            model, folder, "model.", partial))
        fabric.print(f"fine-tuning {args.pretrained} ({model_class(module.model)})"
                     + (f"; {trainable_summary(module.model)}" if lora.enabled else "")
                     + (f"; {', '.join(cfg['chosen'])}" if cfg["chosen"] else ""))
    elif cfg["chosen"]:
        fabric.print("; ".join(cfg["chosen"]))

    sampler_kwargs = _sampler_kwargs(fabric)
    sampler = ResumableSampler(train_set, seed=int(data.get("seed", 0)), **sampler_kwargs)
    val_rows = HeldOutRows(val_set, sampler_kwargs["num_replicas"])
    val_sampler = ResumableSampler(val_rows, shuffle=False, **sampler_kwargs)
    train_loader, val_loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(train_set, batch_size=micro, sampler=sampler, collate_fn=collate, drop_last=True),
        torch.utils.data.DataLoader(val_rows, batch_size=micro, sampler=val_sampler, collate_fn=collate),
        use_distributed_sampler=False)
    if len(train_loader) == 0:
        raise DataError(f"{len(train_set)} packed rows make no batch of {micro} per rank on {dp} ranks; use more"
                        " data or a smaller train.micro_batch_size")

    state = {"model": model, "optimizer": optimizer, "sampler": sampler, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)
    run = {"args": args, "cfg": cfg, "tokenizer": tokenizer, "accumulation": accumulation, "steps": steps,
           "train_loader": train_loader, "val_loader": val_loader, "sampler": sampler, "module": module,
           "stats": stats, "bad_lines": bad, "attention": attention, "seq_len": seq_len,
           "data_replies": first_replies(dialogues, cfg["train"].get("prompts") or [])}
    return fabric, state, run


def model_class(model: torch.nn.Module) -> str:
    """The model's own class name (FSDP2 puts a generated ``FSDP<name>`` class in front of it)."""
    return next(c.__name__ for c in type(model).__mro__ if not c.__module__.startswith("torch."))


def first_replies(dialogues: list[Any], prompts: list[str]) -> dict[str, str]:
    """The training data's reply to each prompt that opens one of its dialogues (the first such dialogue)."""
    replies: dict[str, str] = {}
    for dialogue in dialogues:
        messages = dialogue["messages"] if isinstance(dialogue, dict) else dialogue
        if len(messages) >= 2 and messages[0]["content"] in prompts:
            replies.setdefault(messages[0]["content"], messages[1]["content"])
    return replies


def _sampler_kwargs(fabric: L.Fabric) -> dict[str, int]:
    """Data-parallel size and rank (ranks of one tensor/pipeline group share data). Before the processes are set
    up (plain `python`, ahead of fabric.launch) the strategy cannot say yet: every rank is then data-parallel."""
    try:
        kwargs = getattr(fabric.strategy, "distributed_sampler_kwargs", None) or {}
    except (AssertionError, RuntimeError):
        kwargs = {}
    return {"num_replicas": int(kwargs.get("num_replicas", fabric.world_size)),
            "rank": int(kwargs.get("rank", fabric.global_rank))}


def batches(loader: Any, sampler: ResumableSampler) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches; each epoch reshuffles. A resumed sampler starts at its saved position."""
    while True:
        yield from loader
        sampler.set_epoch(sampler.epoch + 1)


def validate(fabric: L.Fabric, state: dict[str, Any], run: dict[str, Any]) -> dict[str, float]:
    """Held-out loss and perplexity, token-weighted over every rank (all ranks take part)."""
    model, module = state["model"], run["module"]
    model.eval()
    module.reset_validation()
    with torch.no_grad():
        for i, batch in enumerate(run["val_loader"]):
            model.validation_step(batch, i)
    model.train()
    return module.validation_metrics()


def fit(fabric: L.Fabric, state: dict[str, Any], run: dict[str, Any]) -> None:
    steps, eval_every = run["steps"], int(run["cfg"]["train"].get("eval_every", 10))
    # Report the rate at the evaluations (or at the end of a run shorter than eval_every); a rate needs 2 steps.
    every = max(2, min(eval_every, steps - state["step"]))
    throughput = Throughput(transformer=run["module"].config, every_n_steps=every, seq_len=run["seq_len"])
    data = batches(run["train_loader"], state["sampler"])
    state["losses"] = {}
    start = time.perf_counter()
    progress = StepProgress(total=steps, description="train", enabled=fabric.is_global_zero, start=state["step"])
    with progress:
        for step in range(state["step"] + 1, steps + 1):
            train_step(fabric, state, run, step, data, throughput, progress, start)
    wait_checkpoint(fabric.strategy)  # the last checkpoint written in the background is complete
    state["seconds"] = time.perf_counter() - start


def train_step(fabric: L.Fabric, state: dict[str, Any], run: dict[str, Any], step: int, data: Iterator[Any],
               throughput: Throughput, progress: StepProgress, start: float) -> None:
    """One optimizer step (all micro-steps), its logs, and the evaluation/checkpoint due at this step."""
    model, optimizer, sampler = state["model"], state["optimizer"], state["sampler"]
    acc: GradientAccumulation = run["accumulation"]
    cfg, steps = run["cfg"], run["steps"]
    eval_every = int(cfg["train"].get("eval_every", 10))
    save_every = run["args"].save_every
    watchdog.set_step(f"training step {step}")
    watchdog.stall_point(f"step-{step}")
    lr = set_lr(optimizer, run["module"].hparams, step - 1)
    step_loss, tokens, samples = torch.zeros((), device=fabric.device), 0, 0
    for micro in range(acc.steps):
        batch = next(data)
        with acc.micro_step(fabric, model, micro):
            loss = model.training_step(batch, micro)
            fabric.backward(acc.scale(fabric, loss))
        sampler.advance(batch["input_ids"].shape[0])  # trained on: a checkpoint from now on skips it
        step_loss += loss.detach() / acc.steps
        tokens, samples = tokens + batch["input_ids"].numel(), samples + batch["input_ids"].shape[0]
    optimizer.step()
    optimizer.zero_grad()
    state["step"] = step
    rates = throughput.step(fabric, tokens=tokens, samples=samples)
    if rates:
        state["tokens_per_s"] = rates["throughput/tokens_per_s"]
    loss_value = fabric.all_reduce(step_loss, reduce_op="mean").item()
    state["losses"][step] = loss_value
    fabric.log_dict({"train/loss": loss_value, "train/lr": lr,
                     "time/elapsed_s": time.perf_counter() - start}, step=step)
    progress.update(loss=round(loss_value, 4))
    if run["args"].log_every and step % run["args"].log_every == 0:
        progress.print(f"step {step:4d}  train loss {loss_value:.6f}")
    if step % eval_every == 0 or step == steps:
        held_out = validate(fabric, state, run)
        fabric.log_dict(held_out, step=step)
        tps = f"{state['tokens_per_s']:,.0f}" if "tokens_per_s" in state else "-"
        progress.print(f"step {step:4d}  train loss {loss_value:.3f}  held-out loss {held_out['val/loss']:.3f}"
                       f"  held-out perplexity {held_out['val/ppl']:.1f}  {tps} tokens/s")
        state["held_out"] = held_out
    if save_every and step % save_every == 0:
        path = Path(run["args"].out) / "checkpoints" / f"step-{step:06d}"
        fabric.save(path, state_to_save(state))
        progress.print(f"saved {path}")


def set_lr(optimizer: Any, hparams: Any, step: int) -> float:
    """Warm-up then cosine decay (DialogueLM's schedule) for 0-based optimizer ``step``; returns the rate set."""
    lr = hparams.lr * lr_factor(step, hparams.warmup_steps, hparams.max_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def state_to_save(state: dict[str, Any]) -> dict[str, Any]:
    return {k: state[k] for k in ("model", "optimizer", "sampler", "step")}


def export(fabric: L.Fabric, state: dict[str, Any], run: dict[str, Any], name: str = "hf") -> Path:
    """The HF folder --out/NAME: the strategy gathers the full weights of DialogueLM.model (prefix "model.").
    With LoRA: the adapter folder --out/adapter (peft's format, the tokenizer beside it), or with --merge the
    merged model as the HF folder."""
    model, module, args = state["model"], run["module"], run["args"]
    strategy_export = getattr(fabric.strategy, "export_full", None)
    lora: LoraSettings = run["cfg"]["lora"]

    def write_full(path: Path) -> None:
        if strategy_export is not None:
            strategy_export(model, path, prefix="model.")
        else:  # single-device strategies: the module is whole already
            export_safetensors(module, path, prefix="model.")

    if not lora.enabled:
        return export_hf(Path(args.out) / name, write_full, module.config, run["tokenizer"])
    layers = adapter_layers(module.model)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".export-", dir=args.out) as tmp:
        full = Path(tmp) / "lora.safetensors"
        write_full(full)  # collective; rank 0 holds the file
        if args.merge:
            def write_merged(path: Path) -> None:
                if fabric.is_global_zero:
                    write_safetensors(split_export(load_file(full), layers, merge=True), path)
            return export_hf(Path(args.out) / name, write_merged, module.config, run["tokenizer"])
        out = Path(args.out) / ("adapter" if name == "hf" else f"adapter_{name.removeprefix('hf_')}")
        if fabric.is_global_zero:
            write_adapter(out, split_export(load_file(full), layers, merge=False), lora,
                          base_model=str(Path(args.pretrained).resolve()), tokenizer=run["tokenizer"])
        fabric.barrier()
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        fabric, state, run = setup(args)
    except (DataError, FileNotFoundError, ValueError) as e:  # bad data, paths or sizes: the message says the fix
        raise SystemExit(f"dialogue_llm: error: {e}") from None
    module, stats = run["module"], run["stats"]
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
    family = model_class(module.model).removesuffix("ForCausalLM")
    fabric.print(f"{type(fabric.strategy).__name__} on {fabric.world_size} x {fabric.device.type}: {family} with "
                 f"{n_params / 1e6:.2f}M parameters; {stats['dialogues']} dialogues ({run['bad_lines']} bad lines "
                 f"skipped) -> {stats['train_rows']} packed rows of {run['seq_len']} tokens, {stats['val_rows']} "
                 f"held out; {run['accumulation'].steps} micro-step(s) per optimizer step")
    attention = sorted(set(run["attention"].values()))
    fabric.print(f"attention: {', '.join(attention) or 'unchanged'}")
    if run["cfg"]["train"].get("activation_checkpointing"):
        fabric.print("activation checkpointing: every decoder layer recomputed in backward")
    if state["step"]:
        fabric.print(f"resumed at step {state['step']} (epoch {state['sampler'].epoch}, "
                     f"sample {state['sampler'].position} of this rank's share)")
    wall_start = time.perf_counter()
    if fabric.is_global_zero:
        start_run(args.out, recipe="recipes/nlp/dialogue_llm.py", strategy=fabric.strategy,
                  world_size=fabric.world_size, device=fabric.device.type,
                  precision=str(fabric.strategy.precision.precision), parameters=n_params, config=args.config)
    before = validate(fabric, state, run)
    fabric.log_dict(before, step=state["step"])
    fabric.print(f"held-out loss before training {before['val/loss']:.3f}  held-out perplexity before training "
                 f"{before['val/ppl']:.1f}  (chance: {math.log(len(run['tokenizer'])):.3f})")
    with one_line_failures("dialogue_llm", args.out):  # a full disk, a stalled collective, a bad checkpoint
        start = export_start(fabric, state, run, before)
        fit(fabric, state, run)
        out = export(fabric, state, run)
    fabric.print(f"done: {state['step']} steps in {state['seconds']:.1f}s; exported {out}")
    if start is not None:
        print_replies(fabric, run, start, out, state)
    elif fabric.is_global_zero:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        prompt = run["cfg"]["train"].get("prompt", "Hello, how are you?")
        print(f"sample  user: {prompt}\n        assistant: {reply_from_export(out, prompt)}", flush=True)
    if fabric.is_global_zero:
        finish_run(fabric, args, time.perf_counter() - wall_start)
    fabric.barrier()


def finish_run(fabric: L.Fabric, args: argparse.Namespace, wall_s: float) -> None:
    """Rank 0 after training: close the loggers, record the wall time, draw the run report."""
    for logger in fabric.loggers:
        logger.finalize("success")
    write_run_info(args.out, finished=True, wall_s=round(wall_s, 2))
    if args.no_report:
        return
    if "csv" not in args.logger:
        print(f"no report: it is drawn from the CSV logs and --logger {args.logger!r} has no csv")
        return
    png, md = write_report(args.out)
    print(f"report: {png} and {md}")

def export_start(fabric: L.Fabric, state: dict[str, Any], run: dict[str, Any],
                 held_out: dict[str, float]) -> tuple[Path, str] | None:
    """When train.prompts is set: the model as it starts, exported to --out/hf_before (collective), and its label."""
    if not run["cfg"]["train"].get("prompts"):
        return None
    when = f"at step {state['step']}" if state["step"] else "before training"
    return export(fabric, state, run, "hf_before"), f"{when} (ppl {held_out['val/ppl']:,.0f})"


def print_replies(fabric: L.Fabric, run: dict[str, Any], start: tuple[Path, str], out: Path,
                  state: dict[str, Any]) -> None:
    """Rank 0: train.prompts answered by the starting and the trained model, same seed and sampling, side by side."""
    if fabric.is_global_zero:
        train = run["cfg"]["train"]
        prompts, sampling = list(train["prompts"]), Sampling(**(train.get("sampling") or {}))
        ppl = f" (ppl {state['held_out']['val/ppl']:,.0f})" if "held_out" in state else ""
        table = side_by_side(prompts, sample_replies(start[0], prompts, sampling),
                             sample_replies(out, prompts, sampling), start[1], f"after {state['step']} steps{ppl}",
                             expected=[run["data_replies"].get(p) for p in prompts])
        print(table, flush=True)
    fabric.barrier()


if __name__ == "__main__":
    main()
