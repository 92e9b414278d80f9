"""Collisionless ids for the DeepFM tables: torchrec managed collisions under disttrain_recsys on 1 and 2 CPU
processes (no collision, exact resume, a move to another process count, the warm start from hashed tables),
the per-day counts of new ids, collisions and evictions, and the daily job recording them and resuming exactly
after a kill."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import ROOT, run_dist, run_python

from disttrain.recsys.data import parse_day_file
from disttrain.recsys.ids import IdCounts
from disttrain.recsys.synthetic import make_days

RECIPE = ROOT / "recipes" / "recsys" / "deepfm_daily.py"
TINY = ROOT / "configs" / "recsys" / "deepfm_tiny.yaml"


def model_config(ids: str, rows: int = 64) -> dict:
    return {"embedding_dim": 8, "num_embeddings_per_feature": [rows] * 26, "ids": ids,
            "managed_collisions": {"input_hash_size": 2 ** 32}}


def test_id_counts_new_ids_and_collisions_carry_over_a_save(tmp_path):
    """Three days with ~30% new ids a day: hashed tables of 64 rows count collisions, managed ones count none; the
    counts of day 3 are the same after the state went through a save (what a resume or a warm start reads)."""
    days = [parse_day_file(p).cats for p in make_days(tmp_path, 3, 2000, new_ids=0.3)]
    hashed, managed = IdCounts(model_config("hashed")), IdCounts(model_config("managed"))
    first = [hashed.count_day(f"d{k}", day) for k, day in enumerate(days)]
    second = [managed.count_day(f"d{k}", day) for k, day in enumerate(days)]
    distinct = [sum(len(np.unique(day[:, f][day[:, f] != 0])) for f in range(26)) for day in days]
    assert first[0]["new_ids"] == distinct[0] == second[0]["new_ids"]  # the first day: every id is new
    assert 0.2 * distinct[1] < first[1]["new_ids"] < 0.6 * distinct[1]
    assert all(f["collisions"] > 0 for f in first) and "collisions" not in second[0]
    assert first[0]["collisions"] == sum(max(0, len(np.unique(days[0][:, f][days[0][:, f] != 0])) - len(
        np.unique(days[0][:, f][days[0][:, f] != 0] % 64))) for f in range(26))  # ids beyond each row's first
    resumed = IdCounts(model_config("hashed"))
    resumed.count_day("d0", days[0]), resumed.count_day("d1", days[1])
    saved = tmp_path / "state.pt"
    import torch

    torch.save(resumed.state(), saved)
    again = IdCounts(model_config("hashed")).restore(torch.load(saved, weights_only=True))
    assert again.count_day("d2", days[2]) == first[2]


@pytest.mark.slow
def test_managed_tables_on_one_and_two_processes(tmp_path):
    """2 processes, then 1: held ids distinct, each on a row of its own; save, load and two more steps give bitwise
    the tables of the uninterrupted run; the 2-process checkpoint loads on 1 process with every id, row, optimizer
    state and prediction it held; a hashed model warm-started into managed tables predicts the ids it admitted
    bitwise as the hashed model did."""
    two = run_dist("recsys_mc.py", tmp_path, "-", nproc=2)
    (tmp_path / "one").mkdir()
    one = run_dist("recsys_mc.py", tmp_path / "one", str(tmp_path / "result-managed-2"), nproc=1)
    for rank in two + one:
        assert rank["distinct_ids"] and rank["distinct_rows"], rank["held"]
        assert rank["loaded_bitwise"] and rank["resumed_bitwise"], (rank["differ"], rank["maxdiff"])
        assert rank["migrated_probe"] == rank["hashed_probe"]
    # Not every id seen is held on 2 processes: torchrec sizes each process's buffer of ids awaiting admission from
    # the first batch it routes there (x 1.25), and a later, larger share waits for the next interval.
    assert all(two[0]["held"][t] <= one[0]["held"][t] for t in one[0]["held"])
    # the 2-process checkpoint on 1 process: every id it held, with its row and row-wise Adagrad state, and the same
    # predictions on them (1 process has room for both halves)
    moved = one[0]
    assert moved["moved_held"] == two[0]["held_ids"]
    assert moved["moved_rows"] == two[0]["rows"] and len(moved["moved_rows"]) > 10
    assert moved["moved_probe"] == two[0]["held_probe"]
    # and back, the 1-process checkpoint on 2 processes: each keeps the ids of its input range (ids // 500), as
    # many as its part holds (63 of 64 rows), the most frequent first, each with its row and optimizer state
    (tmp_path / "back").mkdir()
    back = run_dist("recsys_mc.py", tmp_path / "back", str(tmp_path / "one" / "result-managed-1"), nproc=2)
    for table, ids in one[0]["held_ids"].items():
        routed = [sum(1 for i in ids if i // 500 == r) for r in (0, 1)]
        assert len(back[0]["moved_held"][table]) == sum(min(n, 63) for n in routed), table
        assert set(back[0]["moved_held"][table]) <= set(ids)
    kept = back[0]["moved_rows"]
    assert kept and all(kept[i] == one[0]["rows"][i] for i in kept)


def daily(data: Path, models: Path, config: Path, *args: str) -> None:
    run = run_python(str(RECIPE), "--data-root", str(data), "--model-root", str(models), "--accelerator", "cpu",
                     "--config", str(config), "--skip-validation", "--min-auc", "0", *args)
    assert run.returncode in (0, 3), run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.slow
def test_daily_job_counts_ids_and_moves_a_hashed_model_to_managed_ids(tmp_path):
    """Day 1 trained with hashed tables (collisions counted), days 2 and 3 with managed ones warm-started from it
    (evictions counted, no collisions); the records and report.md show the figures."""
    data, models = tmp_path / "data", tmp_path / "models"
    make_days(data, 3, 3000, new_ids=0.3)
    recipe = yaml.safe_load(TINY.read_text())
    recipe["model"]["num_embeddings_per_feature"] = [64] * 26  # smaller than most columns' vocabularies
    hashed, managed = tmp_path / "hashed.yaml", tmp_path / "managed.yaml"
    hashed.write_text(yaml.safe_dump(recipe))
    recipe["model"]["ids"] = "managed"
    # lru: new ids displace the least recently seen (lfu would keep the migrated ids, counted over two days)
    recipe["model"]["managed_collisions"]["eviction_policy"] = "lru"
    managed.write_text(yaml.safe_dump(recipe))
    daily(data, models, hashed, "--run-date", "2026-11-01")
    daily(data, models, managed)
    runs = {p.stem: json.loads(p.read_text()) for p in sorted((models / "runs").glob("*.json"))}
    first = runs["2026-11-01"]["ids"]["2026-11-01"]
    assert first["ids"] == "hashed" and first["collisions"] > 0 and first["new_ids"] > 0
    for day in ("2026-11-02", "2026-11-03"):
        figures = runs[day]["ids"][day]
        assert figures["ids"] == "managed" and "collisions" not in figures
        assert figures["evictions"] > 0 and 0 < figures["new_ids"] < first["new_ids"]
    report = (models / "report.md").read_text()
    assert "| reason | new ids | collisions | evictions |" in report
    assert f"|  | {first['new_ids']:,} | {first['collisions']:,} | - |" in report


@pytest.mark.slow
def test_a_daily_job_with_managed_ids_killed_after_a_day_resumes_to_the_uninterrupted_model(tmp_path):
    """Three days with ~30% new ids on managed tables of 64 rows (evictions every day): a run killed after its
    second day publishes nothing; the rerun resumes from that day's work and publishes the model (tables, their
    remapping, optimizer state, dense part) and id counts an uninterrupted run publishes, bitwise."""
    import torch

    from disttrain.parallel.checkpoint.io import read_full
    from disttrain.recsys.delta import leaves

    data = tmp_path / "data"
    make_days(data, 3, 3000, new_ids=0.3)
    recipe = yaml.safe_load(TINY.read_text())
    recipe["model"].update(num_embeddings_per_feature=[64] * 26, ids="managed")
    config = tmp_path / "managed.yaml"
    config.write_text(yaml.safe_dump(recipe))
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    daily(data, straight, config)
    args = ("--data-root", str(data), "--model-root", str(killed), "--accelerator", "cpu", "--config", str(config),
            "--skip-validation", "--min-auc", "0")
    crashed = run_python(str(RECIPE), *args, env={"DISTTRAIN_DAILY_CRASH_AT": "after-day-2026-11-02"})
    assert crashed.returncode == 86 and "2026-11-02: trained" in crashed.stdout, crashed.stdout[-2000:]
    assert not (killed / "current").exists()
    resumed = run_python(str(RECIPE), *args)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout and "2026-11-03: trained" in resumed.stdout
    assert "2026-11-02: trained" not in resumed.stdout

    def published(models: Path) -> dict:
        return {key: value for key, value, _, _ in leaves(read_full(models / "current"))}

    expected, got = published(straight), published(killed)
    assert got.keys() == expected.keys()
    assert any("managed_collision" in key for key in got) and any("embedding_bags" in key for key in got)
    different = [key for key, value in got.items() if not (torch.equal(value, expected[key])
                                                            if isinstance(value, torch.Tensor) else
                                                            key.startswith("meta/info") or value == expected[key])]
    assert not different, different[:10]
    # the dense optimizer's state and the id counts (what the next day counts new ids against)
    metas = [torch.load(models / "current" / "meta.pt", weights_only=True) for models in (straight, killed)]
    for part in ("dense_optimizer", "id_counts"):
        flat = [{key: value for key, value, _, _ in leaves(meta[part])} for meta in metas]
        assert flat[0].keys() == flat[1].keys() and flat[0]
        assert all(torch.equal(v, flat[0][k]) if isinstance(v, torch.Tensor) else v == flat[0][k]
                   for k, v in flat[1].items()), part
    runs = {p.stem: json.loads(p.read_text()) for p in sorted((killed / "runs").glob("*.json"))}
    assert runs["2026-11-03"]["ids"]["2026-11-03"]["evictions"] > 0
