"""BatchNorm statistics under one strategy on 2 CPU processes, for comparison with Lightning's ``ddp``: a small
BatchNorm CNN and a timm ResNet-18 under the Trainer (3 steps, then the epoch-end validation), the CNN under Fabric,
and what ``sync_batchnorm`` does on CPU. Usage: batchnorm_run.py OUT STRATEGY (``ddp`` is Lightning's own)."""

import os
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import disttrain  # noqa: F401  (registers the strategy names)

sys.path.insert(0, os.path.dirname(__file__))
from common import strategy_from_spec, write_result  # noqa: E402

spec = sys.argv[2]
STEPS, BATCH, SIZE = 3, 2, 16


def images(n: int, seed: int, size: int = SIZE) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, size, size, generator=g) * 2 + 0.5, torch.randint(0, 4, (n,), generator=g))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))


def resnet() -> nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("resnet18", pretrained=False, num_classes=4)


def statistics(model: nn.Module) -> list[float]:
    """Every BatchNorm layer's running mean and variance, in module order."""
    stats = [t for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             for t in (m.running_mean, m.running_var)]
    return torch.cat([t.detach().float().reshape(-1).cpu() for t in stats]).tolist()


class Classifier(L.LightningModule):
    def __init__(self, build) -> None:
        super().__init__()
        self.net = build()
        self.rank_val: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.rank_val.append(loss.item())
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def fit(build, strategy_spec: str, image_size: int = SIZE, **kw) -> dict:
    module = Classifier(build)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy_from_spec(strategy_spec, "trainer"),
                        max_epochs=1, limit_train_batches=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)
    trainer.fit(module, DataLoader(images(16, 1, image_size), batch_size=BATCH),
                DataLoader(images(8, 2, image_size), batch_size=BATCH))
    return {"val_loss": trainer.callback_metrics["val_loss"].item(), "rank_val": module.rank_val,
            "stats": statistics(module.net), "global_step": trainer.global_step}


def refusal(run) -> str | None:
    """The error a run ends with (``None`` when it trains)."""
    try:
        run()
    except ValueError as e:
        return f"ValueError: {e}"
    return None


def launched(strategy) -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()  # under torchrun: the processes exist already
    return fabric


def fabric_run(strategy) -> dict:
    """3 steps on each rank's half of the global batch, then an evaluation forward on one fixed batch."""
    fabric = launched(strategy)
    model = cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = images(4 * STEPS, 3).tensors
    for step in range(STEPS):
        rows = slice(4 * step + fabric.global_rank, 4 * step + 4, fabric.world_size)
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    vx, vy = images(8, 4).tensors
    with torch.no_grad():
        eval_loss = nn.functional.cross_entropy(model(vx), vy).item()
    return {"eval_loss": eval_loss, "stats": statistics(model)}


def fabric_sync_batchnorm() -> None:
    """Lightning's way under Fabric is torch's conversion before setup; ours is the strategy option."""
    if spec == "ddp":
        launched("ddp").setup(nn.SyncBatchNorm.convert_sync_batchnorm(cnn()))
    else:
        launched(strategy_from_spec(f"{spec}:sync_batchnorm=true", "fabric")).setup(cnn())


result = {
    "trainer_cnn": fit(cnn, spec),
    "trainer_resnet": fit(resnet, spec, image_size=32),
    "fabric_cnn": fabric_run(strategy_from_spec(spec, "fabric")),
    "trainer_sync_batchnorm": refusal(lambda: fit(cnn, spec, sync_batchnorm=True)),
    "fabric_sync_batchnorm": refusal(fabric_sync_batchnorm),
}
if spec == "disttrain_fsdp":
    result["trainer_cnn_own_buffers"] = fit(cnn, "disttrain_fsdp:broadcast_buffers=false")
    result["trainer_cnn_megatron"] = fit(cnn, "disttrain_megatron")
    result["megatron_sync_batchnorm"] = refusal(lambda: fit(cnn, "disttrain_megatron", sync_batchnorm=True))
write_result(result)
