"""disttrain_recsys on N CPU processes (N = 1 is the reference): Trainer training + held-out AUC, a sharded
checkpoint round trip, Fabric training + save/load, a row-wise constraint, and the guard of disttrain_ddp.

argv: OUT DATA_FILE
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from common import write_result

import disttrain  # noqa: F401  (registers disttrain_recsys)
from disttrain.parallel.engines.recsys import RecsysEngine, RecsysOptions, dense_parameters
from disttrain.recsys.daily import evaluate
from disttrain.recsys.data import DayBatches, load_day, split_rows
from disttrain.recsys.model import DeepFM, DeepFMNet, feature_names, to_kjt

warnings.filterwarnings("ignore")
CONFIG = {"embedding_dim": 8, "num_embeddings_per_feature": [500] * 26, "bottom_mlp": [16, 8], "deep_mlp": [32],
          "sparse_optimizer": {"name": "rowwise_adagrad", "lr": 0.05}}
GLOBAL_BATCH, EVAL_FRACTION = 1024, 0.2


def quiet_trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False, **kwargs)


def main() -> None:
    out, data_file = sys.argv[1], Path(sys.argv[2])
    world = int(os.environ["WORLD_SIZE"])
    day = load_day(data_file, Path(out).parent / f"cache{os.environ['RANK']}")
    train_rows, _ = split_rows(day.rows, EVAL_FRACTION)
    batch = GLOBAL_BATCH // world  # the same global batch at every world size

    # Trainer: two epochs, every rank its share of each global batch.
    torch.manual_seed(0)
    module = DeepFM(CONFIG, lr=3e-3)
    dataset = DayBatches(day, train_rows, GLOBAL_BATCH, module.table_sizes)
    rank = int(os.environ["RANK"])

    class Shard(torch.utils.data.Dataset):  # rank r takes rows r::world of each global batch
        def __len__(self):
            return len(dataset)

        def __getitem__(self, i):
            return tuple(t[rank::world] for t in dataset[i])

    loader = torch.utils.data.DataLoader(Shard(), batch_size=None, shuffle=False)
    trainer = quiet_trainer(strategy="disttrain_recsys", max_epochs=2)
    trainer.fit(module, loader)
    metrics = evaluate(module, day, EVAL_FRACTION, batch)
    plan = str(module.net.plan)

    # Sharded checkpoint: a fresh module restores the shards and fused optimizer state.
    ckpt = Path(out).parent / "trainer_ckpt"
    trainer.save_checkpoint(ckpt)
    fresh = DeepFM(CONFIG, lr=3e-3)
    engine = RecsysEngine(RecsysOptions())
    engine.parallelize(fresh, torch.device("cpu"))
    meta = engine.load(ckpt, fresh)
    restored = evaluate(fresh, day, EVAL_FRACTION, batch)
    fused_before = module.net.fused_optimizer.state_dict()["state"]
    fused_after = fresh.net.fused_optimizer.state_dict()["state"]
    fused_equal = all(_equal(fused_before[k], fused_after[k]) for k in fused_before)
    resumed = quiet_trainer(strategy="disttrain_recsys", max_epochs=3)
    again = DeepFM(CONFIG, lr=3e-3)
    resumed.fit(again, loader, ckpt_path=ckpt)

    # Fabric: a table-wise constraint on one table, 6 steps, save, one more step, load: the saved model is back.
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=disttrain.fabric.RecsysStrategy(
        constraints={"t_cat_0": {"sharding_types": ["table_wise"]}}))
    fabric.launch()
    torch.manual_seed(0)
    net = DeepFMNet(**CONFIG)
    adam = torch.optim.Adam(dense_parameters(net), lr=3e-3)
    model, adam = fabric.setup(net, adam)
    keys = feature_names()

    def step(i: int) -> None:
        dense, sparse, labels = Shard()[i]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, to_kjt(sparse, keys)), labels)
        fabric.backward(loss)
        adam.step()
        adam.zero_grad()

    def probe() -> list[float]:
        dense, sparse, _ = dataset[len(dataset) - 1]
        with torch.no_grad():
            return model(dense[:8], to_kjt(sparse[:8], keys)).tolist()

    for i in range(6):
        step(i)
    fabric_ckpt = Path(out).parent / "fabric_ckpt"
    fabric.save(fabric_ckpt, {"model": model, "optimizer": adam, "step": 6})
    saved = probe()
    step(6)
    moved = probe()
    state = {"model": model, "optimizer": adam, "step": 0}
    fabric.load(fabric_ckpt, state)
    loaded = probe()
    fabric_plan = str(model._forward_module.plan)  # the DMP fabric.setup returned

    # Another disttrain strategy on a model with torchrec tables: a clear error naming disttrain_recsys.
    guard = ""
    try:
        ddp = L.Fabric(accelerator="cpu", devices=world, strategy="disttrain_ddp")
        ddp.launch()
        ddp.setup(DeepFMNet(**CONFIG))
    except TypeError as e:
        guard = str(e)

    write_result({"world": world, "metrics": metrics, "restored": restored, "fused_equal": fused_equal,
                  "meta_keys": sorted(meta), "resumed_step": resumed.global_step, "steps": trainer.global_step,
                  "plan": plan, "fabric_plan": fabric_plan, "saved": saved, "moved": moved, "loaded": loaded,
                  "step_after_load": state["step"], "guard": guard,
                  "local_rows": {n: _local_rows(p) for n, p in module.net.state_dict().items() if "ebc" in n}})
    dist.barrier()


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return all(_equal(a[k], b[k]) for k in a)
    if hasattr(a, "local_shards"):
        return all(torch.equal(x.tensor, y.tensor) for x, y in zip(a.local_shards(), b.local_shards()))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _local_rows(tensor) -> int:
    if hasattr(tensor, "local_shards"):
        return sum(s.tensor.numel() for s in tensor.local_shards())
    return tensor.numel()


if __name__ == "__main__":
    main()
