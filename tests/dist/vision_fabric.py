"""ViTClassifier through Fabric + a disttrain strategy on 2 CPU processes: training_step and validation_step
through the strategy (losses, top-1 accuracy), save after step 3 and resume into a fresh meta-device model, export
for timm. Usage: vision_fabric.py OUT [STRATEGY] [activation_checkpointing: 0|1]

Also imported by tests/test_vision.py for the single-process reference (nothing runs on import)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

MODEL = dict(img_size=16, patch_size=4, num_classes=5, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0)
GLOBAL_BATCH, STEPS, SAVE_AFTER = 8, 5, 3


def batch(step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (rank's share of it when world_size > 1): fixed random images and labels."""
    g = torch.Generator().manual_seed(100 + step)
    images = torch.randn(GLOBAL_BATCH, 3, 16, 16, generator=g)
    target = torch.randint(0, MODEL["num_classes"], (GLOBAL_BATCH,), generator=g)
    return images[rank::world_size], target[rank::world_size]


def classifier(activation_checkpointing: bool = False, build: bool = True):
    from disttrain.vision import TrainConfig, ViTClassifier

    train = TrainConfig(lr=3e-3, weight_decay=0.05, warmup_steps=2, activation_checkpointing=activation_checkpointing)
    vit = ViTClassifier(MODEL, train, total_steps=STEPS)
    if build:
        torch.manual_seed(0)  # the same initial weights in every process and in the reference
        vit.configure_model()
    return vit


def reference() -> dict:
    """One process, the whole global batch per step: what the sharded run must equal."""
    vit = classifier()
    optim = vit.configure_optimizers()
    optimizer, scheduler = optim["optimizer"], optim["lr_scheduler"]["scheduler"]
    losses = []
    for step in range(STEPS):
        loss = vit.training_step(batch(step), step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    vit.eval()
    with torch.no_grad():
        for i in range(2):
            vit.validation_step(batch(50 + i), i)
        probe = vit(batch(99)[0]).tolist()
    return {"losses": losses, **vit.validation_metrics(), "probe": probe}


def main() -> None:
    import lightning as L
    from common import mean_over_ranks, strategy_from_spec, tmpdir, write_result
    from safetensors.torch import load_file

    import disttrain  # noqa: F401
    from disttrain.vision import export_timm
    from disttrain.vision.export import PREFIX

    spec = sys.argv[2] if len(sys.argv) > 2 else "disttrain_fsdp"
    ac = len(sys.argv) > 3 and sys.argv[3] == "1"

    def setup(vit):
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy_from_spec(spec, "fabric"))
        fabric.launch()
        optim = vit.configure_optimizers()
        model, optimizer = fabric.setup(vit, optim["optimizer"])
        return fabric, {"model": model, "optimizer": optimizer, "scheduler": optim["lr_scheduler"]["scheduler"],
                        "step": 0}

    def train(fabric, state, until: int, ckpt: str | None = None) -> list[float]:
        losses = []
        while state["step"] < until:
            loss = state["model"].training_step(fabric.to_device(batch(state["step"], fabric.global_rank, 2)),
                                                state["step"])
            fabric.backward(loss)
            state["optimizer"].step()
            state["optimizer"].zero_grad()
            state["scheduler"].step()
            state["step"] += 1
            losses.append(mean_over_ranks(loss))
            if ckpt and state["step"] == SAVE_AFTER:
                fabric.save(ckpt, state)
        return losses

    vit = classifier(ac)
    fabric, state = setup(vit)
    ckpt = os.path.join(tmpdir(), "vit-ckpt")
    losses = train(fabric, state, STEPS, ckpt)
    state["model"].eval()
    with torch.no_grad():
        for i in range(2):  # each rank sees half of each validation batch; the metrics sync the counts
            state["model"].validation_step(fabric.to_device(batch(50 + i, fabric.global_rank, 2)), i)
    metrics = vit.validation_metrics()
    out = os.path.join(tmpdir(), "vit-export")
    export_timm(out, MODEL, lambda p: fabric.strategy.export_full(state["model"], p, prefix=PREFIX))

    # A fresh model built on the meta device (zero.Init under ZeRO-3), restored from the checkpoint.
    vit2 = classifier(ac, build=False)
    with fabric.init_module(empty_init=True):
        vit2.configure_model()
    fabric2, state2 = setup(vit2)
    fabric2.load(ckpt, state2)
    resumed_step = state2["step"]
    resumed = train(fabric2, state2, STEPS)
    exported = load_file(os.path.join(out, "model.safetensors")) if fabric.global_rank == 0 else {}
    write_result({"losses": losses, "resumed_losses": resumed, "resumed_step": resumed_step, **metrics,
                  "lr_after": state2["scheduler"].get_last_lr()[0], "lr_before": state["scheduler"].get_last_lr()[0],
                  "export_keys": sorted(exported), "grad_checkpointing": vit.model.grad_checkpointing})


if __name__ == "__main__":
    main()
