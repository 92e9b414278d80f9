"""Shared pieces of the multi-process test scripts: a tiny Llama, its data, a LightningModule, result files."""

from __future__ import annotations

import json
import os
import sys

import lightning as L

import disttrain  # noqa: F401  (registers the disttrain_* names)
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

# 12 samples = 3 global steps per epoch at 2 ranks x micro batch 2: a checkpoint at step 3 ends epoch 0.
VOCAB, SEQ, N_SAMPLES, MICRO_BATCH = 96, 16, 12, 2


def tiny_llama(seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="eager", use_cache=False)
    return LlamaForCausalLM(config)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randint(0, VOCAB, (N_SAMPLES, SEQ), generator=g))


def loader() -> DataLoader:
    return DataLoader(dataset(), batch_size=MICRO_BATCH, shuffle=False)


def validation_loss(model, world_size: int) -> float:
    """What ``Trainer.validate`` logs as val_loss on ``world_size`` ranks (unshuffled DistributedSampler, micro
    batch 2, per-rank mean of batch losses, then the mean over ranks), computed in one process."""
    ids = dataset().tensors[0]
    losses = []
    with torch.no_grad():
        for rank in range(world_size):
            mine = ids[rank::world_size]
            losses += [model(input_ids=b, labels=b).loss.item() for b in mine.split(MICRO_BATCH)]
    return sum(losses) / len(losses)


def masked_labels(ids: torch.Tensor) -> torch.Tensor:
    """Mask a different prefix per sample (ids[:, 0] % 10 tokens) so samples carry different token counts."""
    labels = ids.clone()
    for row, keep_from in enumerate((ids[:, 0] % 10).tolist()):
        labels[row, :keep_from] = -100
    return labels


def probe_input() -> torch.Tensor:
    return torch.arange(SEQ).remainder(VOCAB).unsqueeze(0).repeat(2, 1)


class LlamaModule(L.LightningModule):
    """``step_indexed``: train on ``rank_batch(global_step)`` instead of the loader's batch. Lightning restarts a
    plain DataLoader's epoch on resume, so only step-indexed data continues exactly after a checkpoint."""

    def __init__(self, build_in_configure: bool = False, step_indexed: bool = False) -> None:
        super().__init__()
        self.step_indexed = step_indexed
        self.build_in_configure = build_in_configure
        self.model = None if build_in_configure else tiny_llama()
        self.losses: list[float] = []
        self.first_tokens: list[list[int]] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = tiny_llama()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        if self.step_indexed:
            ids = rank_batch(self.global_step, self.global_rank, self.trainer.world_size)
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(mean_over_ranks(loss))
        self.first_tokens.append(ids[:, 0].tolist())
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fabric_train(fabric, model, optimizer, steps: int, start: int = 0, on_step=None) -> list[float]:
    """Steps ``start..steps-1`` on ``rank_batch(step)``; returns the loss averaged over ranks per step.
    ``on_step(step)`` runs after the optimizer step, before gradients are cleared."""
    losses = []
    for step in range(start, steps):
        ids = fabric.to_device(rank_batch(step, fabric.global_rank, fabric.world_size))
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        optimizer.step()
        if on_step is not None:
            on_step(step)
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
    return losses


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def data_parallel_step(fabric, model, optimizer, step: int, dp_mesh) -> float:
    """One optimizer step on this data-parallel rank's share of global batch ``step`` (the ranks of one tensor- or
    pipeline-parallel group read the same samples); returns the global batch's loss (the mean over the
    data-parallel ranks). ``dp_mesh`` None: every rank is a data-parallel rank (DeepSpeed's engines)."""
    if dp_mesh is None:
        dp_rank, dp_size, group = dist.get_rank(), dist.get_world_size(), None
    else:
        dp_rank, dp_size, group = dp_mesh.get_local_rank(), dp_mesh.size(), dp_mesh.get_group()
    ids = global_batch(step, dp_size)[dp_rank::dp_size]
    loss = model(input_ids=ids, labels=ids).loss
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    value = loss.detach().clone()
    dist.all_reduce(value, group=group)
    return value.item() / dp_size


def write_result(result: dict) -> None:
    """Rank r writes <out>.<r>.json (the test reads rank 0's, and others' where it compares ranks)."""
    out = sys.argv[1]
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)


def global_batch(step: int, world_size: int, shuffle_seed: int | None = 0) -> torch.Tensor:
    """The samples of all ranks at 0-based ``step``: what one process trains on in the reference run.

    The Trainer's DistributedSampler shuffles training data with seed 0 (+ epoch); rank r takes every
    world_size-th index, so the union of the ranks' step-k batches is order[k*G:(k+1)*G], G the global batch.
    ``shuffle_seed=None``: sequential order (Fabric's sampler for an unshuffled loader).
    """
    ids = dataset().tensors[0]
    size = MICRO_BATCH * world_size
    per_epoch = len(ids) // size
    epoch, k = divmod(step, per_epoch)
    if shuffle_seed is None:
        order = torch.arange(len(ids))
    else:
        order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(shuffle_seed + epoch))
    return ids[order[k * size:(k + 1) * size]]


def rank_batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's share of ``global_batch(step)``, as the DistributedSampler would hand it out."""
    return global_batch(step, world_size)[rank::world_size]


def reference_losses(steps: int, world_size: int, shuffle_seed: int | None = 0, lr: float = 1e-2,
                     accumulation: int = 1, layers: int = 2) -> list[float]:
    """One process, the global batch per step: what the sharded run must equal. With ``accumulation`` micro-steps
    per optimizer step, optimizer step k covers the global batches of micro-steps k*a .. k*a+a-1."""
    model = tiny_llama(layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        ids = torch.cat([global_batch(step * accumulation + m, world_size, shuffle_seed)
                         for m in range(accumulation)])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def clipped_reference(steps: int, world_size: int, max_norm: float, optimizer=None) -> tuple[list[float], list[float]]:
    """One process, the global batch per step, every step's gradients clipped at ``max_norm``: (losses, gradient
    norms before clipping). ``optimizer``: params -> optimizer (default AdamW at lr 1e-2)."""
    model = tiny_llama()
    opt = (optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-2)))(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        ids = global_batch(step, world_size)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def tmpdir() -> str:
    return os.path.dirname(sys.argv[1])


def strategy_from_spec(spec: str, entry: str):
    """"disttrain_ddp" or "disttrain_ddp:gradient_compression=fp16,powersgd_start_iter=2" -> a strategy (name or
    instance) for the Trainer (entry="trainer") or Fabric (entry="fabric")."""
    import yaml
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    if ":" not in spec:
        return spec
    name, opts = spec.split(":", 1)
    options = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in opts.split(","))}
    row = (StrategyRegistry if entry == "trainer" else STRATEGY_REGISTRY)[name]
    return row["strategy"](**{**row["init_params"], **options})


def tiny_vit(seed: int = 0):
    """A 2-block timm ViT on 32x32 images (4 heads, so tensor parallel 2 splits them)."""
    import timm

    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=64,
                             depth=2, num_heads=4, num_classes=10)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor a DTensor (sharded or replicated) stands for; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def meta_vit_classifier(fabric, model: dict):
    """The ViT recipe's module (``disttrain.vision.ViTClassifier`` of timm keywords ``model``) launched and seeded
    with 0, its model built on the meta device as the recipe builds it, then set up: each rank initialises what it
    holds."""
    from disttrain.vision import TrainConfig, ViTClassifier

    fabric.launch()
    fabric.seed_everything(0)
    vit = ViTClassifier(model, TrainConfig(), total_steps=1)
    with fabric.init_module(empty_init=True):
        vit.configure_model()
    fabric.setup(vit)
    return vit


def vit_batch(step: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of images and labels at ``step`` (the same whatever the world size)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, 3, 32, 32, generator=g), torch.randint(0, 10, (size,), generator=g)


def vit_reference_losses(steps: int, lr: float = 1e-2) -> list[float]:
    model = tiny_vit()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        images, labels = vit_batch(step)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
