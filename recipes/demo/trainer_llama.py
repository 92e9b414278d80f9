"""The README's Trainer example as a script: a small Llama trained with a disttrain strategy.

    python recipes/demo/trainer_llama.py --accelerator cpu --devices 2 --strategy disttrain_fsdp
    torchrun --nproc_per_node 8 recipes/demo/trainer_llama.py --accelerator gpu --devices 8
    srun python recipes/demo/trainer_llama.py --accelerator gpu --devices 8 --num-nodes 4    # SLURM

Saves a sharded checkpoint and a safetensors export of the Llama's full weights under --out, TensorBoard and CSV
logs under --out/logs (--logger) and the run report --out/report.png + report.md (`disttrain report OUT` redraws
them, OUT being the --out folder).
"""

from __future__ import annotations

import argparse
import logging
import time

import lightning as L
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import disttrain  # noqa: F401  (registers the disttrain_* names)
from disttrain.callbacks import Throughput
from disttrain.launch import build_strategy, takes
from disttrain.report import (start_run, strategy_description, trainer_loggers, trainer_progress_callbacks, write_report,
                              write_run_info)

logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # a torchao deprecation notice per process


class LM(L.LightningModule):
    def __init__(self, vocab: int = 1024) -> None:
        super().__init__()
        self.vocab = vocab
        self.model = None

    def configure_model(self) -> None:  # with empty_init=True this runs on the meta device
        if self.model is None:
            self.model = LlamaForCausalLM(LlamaConfig(
                num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=self.vocab, use_cache=False))

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--strategy", default="disttrain_fsdp", help="a name, e.g. disttrain_fsdp_offload")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--out", default="runs/trainer_llama")
    p.add_argument("--logger", default="tensorboard,csv", help="tensorboard,csv | csv | tensorboard | none")
    args = p.parse_args()

    # Activation checkpointing and the meta-device build where the strategy offers both (the registry says which).
    wanted = {"activation_checkpointing": True, "empty_init": True}
    strategy = build_strategy(args.strategy, wanted if all(takes(args.strategy, o) for o in wanted) else {},
                              entry="trainer")
    trainer = L.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices,
                        num_nodes=args.num_nodes, precision=args.precision, max_steps=args.max_steps,
                        logger=trainer_loggers(args.out, args.logger), enable_checkpointing=False,
                        log_every_n_steps=1, enable_progress_bar=True,
                        callbacks=[*trainer_progress_callbacks(), Throughput(every_n_steps=2)])
    start = time.perf_counter()
    data = torch.utils.data.DataLoader(torch.randint(0, 1024, (256, 128)), batch_size=4)
    if trainer.is_global_zero:
        start_run(args.out, recipe="recipes/demo/trainer_llama.py", strategy=trainer.strategy,
                  world_size=trainer.world_size, device=trainer.strategy.root_device.type, precision=args.precision)
    trainer.fit(LM(), data)
    trainer.save_checkpoint(f"{args.out}/ckpt")  # a sharded folder under disttrain_fsdp, written atomically
    if hasattr(trainer.strategy, "export_full"):
        trainer.strategy.export_full(f"{args.out}/model.safetensors", prefix="model.")  # plain HF weights
    trainer.print(f"saved {args.out}/ckpt and {args.out}/model.safetensors")
    if trainer.is_global_zero:
        report(trainer, args, time.perf_counter() - start)


def report(trainer: L.Trainer, args: argparse.Namespace, wall_s: float) -> None:
    """Rank 0: record the wall time (and the strategy again: the Trainer knows its degrees once fit started) and
    draw --out/report.png from the CSV logs."""
    write_run_info(args.out, finished=True, wall_s=round(wall_s, 2), strategy=strategy_description(trainer.strategy))
    if "csv" in args.logger:
        png, md = write_report(args.out)
        print(f"report: {png} and {md}")


if __name__ == "__main__":
    main()
