"""A disttrain_recsys checkpoint moving between world sizes and sharding plans (RecsysEngine, CPU/gloo).
Usage: recsys_reshard.py OUT T_CAT_0_SHARDING LOAD RELOADED SAVE [CORRUPT]

T_CAT_0_SHARDING: the sharding type forced on table t_cat_0 ("column_wise" splits it into two 4-column shards).
LOAD: a checkpoint to warm-start from ("-": a fresh model); RELOADED: where to save right after that load ("-": do
not); then two training steps on a fixed global batch, and a save at SAVE. Predictions of fixed probe rows are
recorded after the load and before the final save. CORRUPT: a damaged checkpoint that engine.load must refuse.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

from common import write_result

from disttrain.parallel.checkpoint.io import CheckpointError
from disttrain.parallel.engines.recsys import RecsysEngine, RecsysOptions, dense_parameters, table_columns
from disttrain.recsys.model import DeepFMNet, feature_names, to_kjt

warnings.filterwarnings("ignore")
CONFIG = {"embedding_dim": 8, "num_embeddings_per_feature": [200] * 26, "bottom_mlp": [16, 8], "deep_mlp": [32],
          "sparse_optimizer": {"name": "rowwise_adagrad", "lr": 0.1}}
KEYS = feature_names()


def batch(seed: int, rows: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 13, generator=g), torch.randint(0, 200, (rows, 26), generator=g),
            (torch.rand(rows, generator=g) < 0.3).float())


def main() -> None:
    out, sharding, load, reloaded, save = sys.argv[1:6]
    corrupt = sys.argv[6] if len(sys.argv) > 6 else None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0 if load == "-" else 1)  # a warm start must not depend on the fresh weights
    engine = RecsysEngine(RecsysOptions(constraints={
        "t_cat_0": {"sharding_types": [sharding], "min_partition": 4},
        "t_cat_1": {"sharding_types": ["row_wise"]}, "t_cat_2": {"sharding_types": ["table_wise"]}}))
    engine.setup_mesh(world, torch.device("cpu"))
    model = engine.parallelize(DeepFMNet(**CONFIG), torch.device("cpu"), whole=True)
    adam = torch.optim.Adam(dense_parameters(model), lr=1e-2)
    probe = batch(1234)

    def predict() -> list[float]:
        with torch.no_grad():
            return model(probe[0], to_kjt(probe[1], KEYS)).tolist()

    result: dict = {"world": world, "columns": table_columns(model.state_dict()["ebc.embedding_bags.t_cat_0.weight"])}
    if corrupt:
        try:
            engine.load(corrupt, model)
            result["corrupt_error"] = None
        except CheckpointError as e:
            result["corrupt_error"] = str(e)
    if load != "-":
        adam.load_state_dict(engine.load(load, model)["dense_optimizer"])
        result["loaded"] = predict()
        if reloaded != "-":
            engine.save(reloaded, model, {"dense_optimizer": adam.state_dict()})
    for step in range(2):
        dense, sparse, labels = (t[rank::world] for t in batch(step))  # every rank its share of one global batch
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, to_kjt(sparse, KEYS)), labels)
        loss.backward()
        adam.step()
        adam.zero_grad()
    result["saved"] = predict()
    engine.save(save, model, {"dense_optimizer": adam.state_dict()})
    write_result(result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
