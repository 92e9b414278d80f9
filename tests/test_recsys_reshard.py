"""Warm start of the daily DeepFM across world sizes and sharding plans: RecsysEngine.load reshards the tables and
their fused optimizer state 2 -> 1 -> 2 processes (CPU, gloo), and refuses a damaged checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_dist
from disttrain.parallel.checkpoint.io import read_full, read_meta
from disttrain.parallel.engines.recsys import ROW_STATE_KEY, regroup_row_state

TOL = 1e-6


def canonical(path: Path) -> dict[str, torch.Tensor]:
    """Everything a checkpoint holds in plan-independent form: table weights as saved (global offsets), per-row
    optimizer state regrouped to whole rows (what the table would hold unsplit)."""
    state, layout = read_full(path), read_meta(path)[ROW_STATE_KEY]
    flat: dict[str, torch.Tensor] = {}

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif isinstance(value, torch.Tensor):
                flat[f"{prefix}{key}"] = value
    walk(state, "")
    for key, columns in layout.items():
        rows = flat[key].numel() // len(columns)
        flat[key] = regroup_row_state(flat[key], rows, columns, [sum(columns)])
    return flat


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=TOL, rtol=1e-5, msg=key)


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 64
    return max(abs(x - y) for x, y in zip(a, b))


def flip_a_table_byte(src: Path, dst: Path) -> str:
    import shutil

    shutil.copytree(src, dst)
    shard = dst / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard.name


@pytest.mark.slow
def test_warm_start_moves_two_to_one_to_two_processes(tmp_path):
    """2 processes (t_cat_0 column-wise in two 4-column shards, t_cat_1 row-wise) train and save; 1 process (t_cat_0
    table-wise) loads, trains, saves; 2 processes load again. After each move the loaded model scores the probe rows
    as the saved one did, and the checkpoint written right after the load holds the same state in plan-independent
    form (row-wise Adagrad's per-row momentum regrouped between the column splits)."""
    a, b = tmp_path / "a", tmp_path / "b"
    first = run_dist("recsys_reshard.py", tmp_path, "column_wise", "-", "-", str(a), nproc=2)[0]
    bad = flip_a_table_byte(a, tmp_path / "a-damaged")
    (tmp_path / "one").mkdir()
    one = run_dist("recsys_reshard.py", tmp_path / "one", "table_wise", str(a), str(tmp_path / "a-at-1"), str(b),
                   str(tmp_path / "a-damaged"), nproc=1)[0]
    (tmp_path / "two").mkdir()
    two = run_dist("recsys_reshard.py", tmp_path / "two", "column_wise", str(b), str(tmp_path / "b-at-2"),
                   str(tmp_path / "c"), nproc=2)[0]

    assert (first["columns"], one["columns"], two["columns"]) == ([4, 4], [8], [4, 4])  # the plans differ
    assert max_diff(one["loaded"], first["saved"]) <= TOL, (one["loaded"][:4], first["saved"][:4])
    assert max_diff(two["loaded"], one["saved"]) <= TOL, (two["loaded"][:4], one["saved"][:4])
    assert max_diff(one["saved"], one["loaded"]) > 1e-3  # training between the moves changed the model
    assert_same(canonical(a), canonical(tmp_path / "a-at-1"))
    assert_same(canonical(b), canonical(tmp_path / "b-at-2"))
    assert json.loads(json.dumps(read_meta(a)[ROW_STATE_KEY]))  # the split is recorded with every save
    error = one["corrupt_error"]
    assert error and "\n" not in error and f"cannot read {bad}" in error and "resume from an earlier" in error


def test_regroup_row_state_is_exact_for_unions_and_keeps_the_row_mean():
    rows = 3
    saved = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0, 30.0, 5.0, 5.0, 5.0])  # three shards of widths 2, 2, 4
    whole = regroup_row_state(saved, rows, [2, 2, 4], [8])
    torch.testing.assert_close(whole, torch.tensor([(2 + 20 + 20) / 8, (4 + 40 + 20) / 8, (6 + 60 + 20) / 8]))
    halves = regroup_row_state(saved, rows, [2, 2, 4], [4, 4])  # unions of saved shards: exact
    torch.testing.assert_close(halves, torch.cat([(saved[:3] + saved[3:6]) / 2, saved[6:]]))
    split = regroup_row_state(whole, rows, [8], [4, 4])  # a split shard: each part starts from the row's mean
    torch.testing.assert_close(split, torch.cat([whole, whole]))
    torch.testing.assert_close(regroup_row_state(split, rows, [4, 4], [8]), whole)
    with pytest.raises(ValueError, match=r"column splits \[4, 4\] and \[6\] cover different widths"):
        regroup_row_state(split, rows, [4, 4], [6])
