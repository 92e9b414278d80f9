"""disttrain_recsys's torchrec pipeline and comms codecs on N CPU processes, each against the plain loop on the same
batches in the same process: the Trainer with pipeline="sparse_dist" (a validation pass mid-epoch, Throughput on)
and "none"; Fabric's train_pipeline and a hand-written loop; comm_precision fp32, fp16 and bf16 (Trainer, losses
and the bytes of the tables' all-to-alls); fp8 refused on CPU.

argv: OUT
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning as L
import torch

from common import write_result

import disttrain  # noqa: F401  (registers disttrain_recsys)
from disttrain.callbacks import Throughput
from disttrain.fabric import RecsysStrategy as FabricRecsys
from disttrain.parallel.engines.recsys import dense_parameters
from disttrain.recsys.model import DeepFM, DeepFMNet, feature_names, table_batch, to_kjt
from disttrain.strategies import RecsysStrategy

warnings.filterwarnings("ignore")
CONFIG = {"embedding_dim": 8, "num_embeddings_per_feature": [60] * 26, "bottom_mlp": [16, 8], "deep_mlp": [16],
          "sparse_optimizer": {"name": "adagrad", "lr": 0.05}}
BATCH, STEPS = 32, 10
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def batches(count: int = STEPS, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed * 100 + RANK)  # each rank its own rows
    return [(torch.randn(BATCH, 13, generator=g), torch.randint(0, 60, (BATCH, 26), generator=g),
             torch.randint(0, 2, (BATCH,), generator=g).float()) for _ in range(count)]


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's tensors: dense parameters and the local shards of the tables."""
    out = {}
    for name, value in module.state_dict().items():
        if hasattr(value, "local_shards"):
            for i, shard in enumerate(value.local_shards()):
                out[f"{name}#{i}"] = shard.tensor.clone()
        elif isinstance(value, torch.Tensor):
            out[name] = value.clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over all tensors (0.0: bitwise equal); inf when the keys differ."""
    if a.keys() != b.keys():
        return float("inf")
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a.values(), b.values()))


def trainer_run(val: bool = False, **options) -> dict:
    torch.manual_seed(0)
    module = DeepFM(CONFIG, lr=3e-3)
    losses, throughput = Losses(), Throughput(every_n_steps=2)
    strategy = RecsysStrategy(constraints={"t_cat_0": {"sharding_types": ["column_wise"]}}, **options)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[losses, throughput], num_sanity_val_steps=0,
                        val_check_interval=4 if val else None, limit_val_batches=2 if val else None)
    loader = torch.utils.data.DataLoader(batches(), batch_size=None)
    val_loader = torch.utils.data.DataLoader(batches(2, seed=1), batch_size=None) if val else None
    trainer.fit(module, loader, val_loader)
    # the tables have their own forward again: a plain call after fit works
    with torch.no_grad():
        dense, sparse, _ = batches(1, seed=2)[0]
        after = module(dense, sparse)
    table = strategy.engine.table_bytes()
    return {"losses": losses.losses, "state": state(module), "after": after, "table": table,
            "metrics": throughput.metrics, "steps": trainer.global_step}


def fabric_run(pipelined: bool, pipeline: str = "sparse_dist") -> dict:
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=FabricRecsys(pipeline=pipeline))
    fabric.launch()
    torch.manual_seed(0)
    net = DeepFMNet(**CONFIG)
    adam = torch.optim.Adam(dense_parameters(net), lr=3e-3)
    model, adam = fabric.setup(net, adam)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    keys = feature_names()
    losses = []
    if pipelined:
        pipe = fabric.strategy.train_pipeline(
            model, adam, lambda b: (loss := loss_fn(model(b.dense, b.sparse), b.labels), loss.detach()))
        it = map(table_batch, batches())
        while True:
            try:
                losses.append(pipe.progress(it).item())
            except StopIteration:
                break
    else:
        for dense, sparse, labels in batches():
            loss = loss_fn(model(dense, to_kjt(sparse, keys)), labels)
            fabric.backward(loss)
            adam.step()
            adam.zero_grad()
            losses.append(loss.item())
    return {"losses": losses, "state": state(model)}


def main() -> None:
    plain, piped = trainer_run(), trainer_run(pipeline="sparse_dist")
    plain_val, piped_val = trainer_run(val=True), trainer_run(val=True, pipeline="sparse_dist")
    fabric_plain, fabric_piped = fabric_run(False), fabric_run(True)
    fabric_none = fabric_run(True, pipeline="none")
    codecs = {p: trainer_run(comm_precision=p) for p in ("fp16", "bf16")}
    try:
        RecsysStrategy(comm_precision="fp8")
        trainer_run(comm_precision="fp8")
        fp8 = "accepted"
    except ValueError as e:
        fp8 = str(e)
    write_result({
        "trainer_losses": [plain["losses"], piped["losses"]],
        "trainer_state_diff": same(plain["state"], piped["state"]),
        "trainer_after_diff": (plain["after"] - piped["after"]).abs().max().item(),
        "val_losses": [plain_val["losses"], piped_val["losses"]],
        "val_state_diff": same(plain_val["state"], piped_val["state"]),
        "steps": [plain["steps"], piped["steps"]],
        "metrics": piped["metrics"],
        "table": {"fp32": plain["table"], **{p: r["table"] for p, r in codecs.items()}},
        "codec_losses": {"fp32": plain["losses"], **{p: r["losses"] for p, r in codecs.items()}},
        "fabric_losses": [fabric_plain["losses"], fabric_piped["losses"], fabric_none["losses"]],
        "fabric_state_diff": same(fabric_plain["state"], fabric_piped["state"]),
        "fabric_none_diff": same(fabric_plain["state"], fabric_none["state"]),
        "fp8": fp8,
    })


if __name__ == "__main__":
    main()
