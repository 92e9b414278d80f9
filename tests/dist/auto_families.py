"""``Trainer(strategy="disttrain_auto")`` on HF models outside the Llama family, against Lightning's own
``strategy="ddp"`` in the same script (same data, seed and DistributedSampler). Usage: auto_families.py OUT MODEL...

MODEL: "gpt2" (GPT2LMHeadModel; default options: the planner picks a replica), "qwen2-moe" and "mixtral" (MoE, with
their auxiliary loss), "deit" and "eva02" (timm DeiT distilled and EVA-02 built for 32x32 images), or "t5"
(T5ForConditionalGeneration, with a device memory between what FSDP and DDP need: the planner must shard). Per model each rank writes the plan's
choice, the losses of both runs (mean over ranks), their validation losses and the largest relative difference of
the trained weights (rank 0, the full model gathered from the chosen strategy).
"""

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import disttrain

sys.path.insert(0, os.path.dirname(__file__))
from common import VOCAB, dataset, mean_over_ranks, tmpdir, write_result  # noqa: E402

STEPS = 3
IMAGES = {"deit": "deit_tiny_distilled_patch16_224", "eva02": "eva02_tiny_patch14_224"}
CLASSES = 5


def images() -> TensorDataset:
    g = torch.Generator().manual_seed(4321)
    return TensorDataset(torch.randn(12, 3, 32, 32, generator=g), torch.randint(0, CLASSES, (12,), generator=g))


def build(name: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if name == "qwen2-moe":  # the planner measures it with transformers' grouped-matmul op on the meta device
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, output_router_logits=True))
    if name == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, output_router_logits=True))
    if name in IMAGES:  # timm models built for 32x32 images: the planner reads the size from the model
        import timm

        return timm.create_model(IMAGES[name], pretrained=False, img_size=32, patch_size=8, num_classes=CLASSES)
    return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                     num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                                     pad_token_id=0))


class LM(L.LightningModule):
    """An HF model trained with the loss it computes from labels, as a user writes it for one process."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.model = build(name)
        self.losses: list[float] = []

    def loss(self, batch) -> torch.Tensor:
        if self.name in IMAGES:
            x, y = batch
            return F.cross_entropy(self.model(x), y)
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(mean_over_ranks(loss))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)  # SGD: weights comparable to 1e-6


def fit(module: LM, strategy) -> tuple[L.Trainer, float]:
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    data = images() if module.name in IMAGES else dataset()
    trainer.fit(module, DataLoader(data, batch_size=2))
    val = trainer.validate(module, DataLoader(data, batch_size=2), verbose=False)[0]["val_loss"]
    return trainer, val


def auto_strategy(name: str):
    if name != "t5":
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
