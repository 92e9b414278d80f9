"""``Trainer(strategy="disttrain_auto")`` on HF models outside the Llama family, against Lightning's own
``strategy="ddp"`` in the same script (same data, seed and DistributedSampler). Usage: auto_families.py OUT MODEL...

MODEL: "gpt2" (GPT2LMHeadModel; default options: the planner picks a replica) or "t5" (T5ForConditionalGeneration,
with a device memory between what FSDP and DDP need: the planner must shard). Per model each rank writes the plan's
choice, the losses of both runs (mean over ranks), their validation losses and the largest relative difference of
the trained weights (rank 0, the full model gathered from the chosen strategy).
"""

import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

import disttrain

sys.path.insert(0, os.path.dirname(__file__))
from common import VOCAB, dataset, mean_over_ranks, tmpdir, write_result  # noqa: E402

STEPS = 3


def build(name: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                     num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                                     pad_token_id=0))


class LM(L.LightningModule):
    """An HF model trained with the loss it computes from labels, as a user writes it for one process."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.model = build(name)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(mean_over_ranks(loss))
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)  # SGD: weights comparable to 1e-6


def fit(module: LM, strategy) -> tuple[L.Trainer, float]:
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(dataset(), batch_size=2))
    val = trainer.validate(module, DataLoader(dataset(), batch_size=2), verbose=False)[0]["val_loss"]
    return trainer, val


def auto_strategy(name: str):
    if name == "gpt2":
        return "disttrain_auto"  # the plain name, as the README shows
    from disttrain.planner import estimate, model_spec

    spec = model_spec(build(name))
    ddp, fsdp = (estimate(spec, s, world_size=2, micro_batch=2, seq_len=16, precision="32-true")
                 for s in ("disttrain_ddp", "disttrain_fsdp"))
    assert fsdp.device < ddp.device, (fsdp.device, ddp.device)
    return disttrain.strategies.AutoStrategy(device_memory=(fsdp.device + ddp.device) // 2, headroom=0.0,
                                             micro_batch=2, seq_len=16)


def check(name: str) -> dict:
    module = LM(name)
    trainer, val = fit(module, auto_strategy(name))
    path = os.path.join(tmpdir(), f"auto-{name}.safetensors")
    trainer.strategy.export_full(path, prefix="model.")
    reference = LM(name)
    _, ref_val = fit(reference, "ddp")  # Lightning's own DDP
    result = {"choice": trainer.strategy.plan.strategy, "losses": module.losses, "ref_losses": reference.losses,
              "val": val, "ref_val": ref_val}
    if trainer.global_rank == 0:
        from safetensors.torch import load_file

        state, ref_state = load_file(path), reference.model.state_dict()
        result["weights_diff"] = max(((state[k] - v).abs().max() / v.abs().max().clamp_min(1e-3)).item()
                                     for k, v in ref_state.items())
    return result


write_result({name: check(name) for name in sys.argv[2:]})
