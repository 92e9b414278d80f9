"""Managed-collision DeepFM tables under disttrain_recsys (RecsysEngine, CPU/gloo).
Usage: recsys_mc.py OUT FOREIGN ("-": none)

Trains two steps on a fixed global batch (every rank its share), then: the held ids are distinct with distinct rows
(no collision); save, load into a fresh model, and two more steps on both give bitwise the same tables (exact
resume); a hashed model trained the same way and warm-started into managed tables predicts the ids it admitted
bitwise as the hashed model did. FOREIGN: a managed checkpoint saved on another number of processes, loaded: its
ids, rows, optimizer state and predictions on the ids it held, as saved.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from common import write_result

from disttrain.parallel.engines.managed_ids import EMPTY, finish_admissions, local_modules, sharded_managed
from disttrain.parallel.engines.recsys import RecsysEngine, RecsysOptions, dense_parameters
from disttrain.recsys.ids import warm_start_from_hashed
from disttrain.recsys.model import DeepFMNet, feature_names, to_kjt

warnings.filterwarnings("ignore")
ROWS = 128  # per table: room for every id of the two training batches on 1 and on 2 processes
HASHED = {"embedding_dim": 8, "num_embeddings_per_feature": [ROWS] * 26, "bottom_mlp": [16, 8], "deep_mlp": [32],
          "sparse_optimizer": {"name": "rowwise_adagrad", "lr": 0.1}}
MANAGED = {**HASHED, "ids": "managed",
           "managed_collisions": {"eviction_policy": "lfu", "eviction_interval": 1, "input_hash_size": 1000}}
KEYS = feature_names()


def batch(seed: int, rows: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 13, generator=g), torch.randint(0, 1000, (rows, 26), generator=g),
            (torch.rand(rows, generator=g) < 0.3).float())


def build(config: dict, engine: RecsysEngine) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = engine.parallelize(DeepFMNet(**config), torch.device("cpu"), whole=True)
    return model, torch.optim.Adam(dense_parameters(model), lr=1e-2)


def train(model: torch.nn.Module, adam: torch.optim.Optimizer, seeds: range, space: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for seed in seeds:
        dense, sparse, labels = (t[rank::world] for t in batch(seed))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(dense, to_kjt(sparse % space, KEYS)), labels)
        loss.backward()
        adam.step()
        adam.zero_grad()
    finish_admissions(model)


@torch.no_grad()
def predict(model: torch.nn.Module, dense: torch.Tensor, sparse: torch.Tensor) -> list[float]:
    """Logits in eval mode (which admits no id: the tables stay as they are)."""
    model.eval()
    logits = model(dense, to_kjt(sparse, KEYS)).tolist()
    model.train()
    return logits


def tables(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shards of every table and managed-collision buffer."""
    return {k: v.local_shards()[0].tensor.clone() for k, v in model.state_dict().items() if hasattr(v, "local_shards")}


def row_values(model: torch.nn.Module, table: str = "t_cat_0") -> dict[str, list[float]]:
    """``{raw id: its row's weights + its row-wise Adagrad state}`` of one table, every rank's ids."""
    for sharded in sharded_managed(model):
        modules = sharded._managed_collision_collection._managed_collision_modules
        if table not in modules:
            continue
        mcm = modules[table]
        tbe, index = sharded._table_to_tbe_and_index[table]
        weights, [momentum] = tbe.split_embedding_weights()[int(index)], tbe.split_optimizer_states()[int(index)]
        mine = mcm._mch_sorted_raw_ids != EMPTY
        rows = mcm._mch_remapped_ids_mapping[mine] - mcm._output_global_offset
        values = {str(int(i)): weights[r].tolist() + [float(momentum[r])]
                  for i, r in zip(mcm._mch_sorted_raw_ids[mine], rows)}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, values)
        return {k: v for part in gathered for k, v in part.items()}
    raise AssertionError(f"no managed table {table}")


def held(model: torch.nn.Module) -> dict[str, list[list[int]]]:
    """Per table, every rank's (raw id, row) pairs."""
    out = {}
    for table, mcm in local_modules(model).items():
        mine = mcm._mch_sorted_raw_ids != EMPTY
        pairs = torch.stack([mcm._mch_sorted_raw_ids[mine], mcm._mch_remapped_ids_mapping[mine]], 1).tolist()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, pairs)
        out[table] = [p for part in gathered for p in part]
    return out


def main() -> None:
    out, foreign = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = RecsysEngine(RecsysOptions())
    engine.setup_mesh(world, torch.device("cpu"))
    result: dict = {"world": world}

    model, adam = build(MANAGED, engine)
    train(model, adam, range(2), 1000)
    pairs = held(model)
    result["held"] = {t: len(p) for t, p in pairs.items()}
    result["distinct_ids"] = all(len({i for i, _ in p}) == len(p) for p in pairs.values())
    result["distinct_rows"] = all(len({r for _, r in p}) == len(p) for p in pairs.values())
    probe = batch(0)
    result["probe"] = predict(model, probe[0], probe[1])
    # a probe of ids every table holds (column f: table f's ids in turn), to predict after a move
    held_probe = (torch.randn(8, 13, generator=torch.Generator().manual_seed(5)),
                  torch.tensor([[sorted(i for i, _ in pairs[f"t_cat_{f}"])[k % len(pairs[f"t_cat_{f}"])]
                                 for f in range(26)] for k in range(8)]))
    result["held_probe"] = predict(model, *held_probe)
    result["held_ids"] = {t: sorted(i for i, _ in p) for t, p in pairs.items()}
    result["rows"] = row_values(model)
    folder = f"{out}-managed-{world}"
    engine.save(folder, model, {"dense_optimizer": adam.state_dict()})
    if rank == 0:
        torch.save(held_probe, f"{folder}.probe.pt")
    resumed, adam2 = build(MANAGED, engine)
    adam2.load_state_dict(engine.load(folder, resumed)["dense_optimizer"])
    fa, fb = model.fused_optimizer.state_dict()["state"], resumed.fused_optimizer.state_dict()["state"]
    result["fused_loaded"] = all(torch.equal(x.local_shards()[0].tensor, fb[p][n].local_shards()[0].tensor)
                                 for p in fa for n, x in fa[p].items() if hasattr(x, "local_shards"))
    result["loaded_bitwise"] = all(torch.equal(a, b) for a, b in zip(tables(model).values(),
                                                                    tables(resumed).values()))
    train(model, adam, range(2, 4), 1000)
    train(resumed, adam2, range(2, 4), 1000)
    a, b = tables(model), tables(resumed)
    result["resumed_bitwise"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    result["differ"] = sorted(k for k in a if not torch.equal(a[k], b[k]))[:2]
    result["maxdiff"] = max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point())
    da, db = model.state_dict(), resumed.state_dict()
    result["dense_differ"] = [k for k in da if not hasattr(da[k], "local_shards") and not torch.equal(da[k], db[k])][:3]
    if foreign != "-":  # a checkpoint of another number of processes: its ids admitted again where they belong
        moved = build(MANAGED, engine)[0]
        engine.load(foreign, moved)
        held_probe = torch.load(f"{foreign}.probe.pt", weights_only=True)
        result["moved_probe"] = predict(moved, *held_probe)
        result["moved_held"] = {t: sorted(i for i, _ in p) for t, p in held(moved).items()}
        result["moved_rows"] = row_values(moved)

    # hashed -> managed: the ids of the hashed model's training batches, each from its hashed row
    hashed, hadam = build(HASHED, engine)
    train(hashed, hadam, range(2), ROWS)
    engine.save(f"{out}-hashed-{world}", hashed, {"dense_optimizer": hadam.state_dict()})
    migrated, _ = build(MANAGED, engine)
    days = [torch.cat([batch(s)[1] for s in range(2)]).numpy()]
    warm_start_from_hashed(engine, migrated, f"{out}-hashed-{world}", MANAGED, days)
    result["hashed_probe"] = predict(hashed, probe[0], probe[1] % ROWS)
    result["migrated_probe"] = predict(migrated, probe[0], probe[1])
    write_result(result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
