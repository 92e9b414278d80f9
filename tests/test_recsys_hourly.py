"""Hourly increments of the recommender job and its delta versions: ``--every 1h`` trains hour files and publishes
what changed since the version it started from; a chain of deltas rebuilds the model trained with full versions;
a publish killed at any point leaves ``current`` on a version that loads; a serving reader never sees a mix."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, child_env, run_torchrun
from test_recsys import RECIPE, daily, records, run_daily, the_error, write_config

from disttrain.parallel.checkpoint.io import read_full
from disttrain.recsys.delta import leaves, load_current, materialize, read_version, unpack_tree
from disttrain.recsys.publish import ModelStore
from disttrain.recsys.synthetic import make_days

HOURLY = ("--every", "1h", "--logger", "none", "--no-report", "--min-auc", "0.5", "--auc-tolerance", "1")


def hour(h: int) -> str:
    return f"2026-11-01_{h:02d}"


def info(models: Path, version: str) -> dict:
    return json.loads((models / "versions" / version / "info.json").read_text())


def flat(state: dict) -> dict[str, object]:
    return {key: value for key, value, _, _ in leaves(state)}


@pytest.fixture(scope="module")
def six_hours(tmp_path_factory):
    """Six hour files trained one run per hour twice: publishing deltas (a full base + 5 deltas) and publishing
    every version in full (daily.full_every: 0)."""
    root = tmp_path_factory.mktemp("hourly")
    data = root / "data"
    make_days(data, 6, 1500, every="1h")
    full = write_config(root / "full.yaml", daily={"full_every": 0})
    runs = {name: [run_daily(data, root / name, *HOURLY, "--run-date", hour(h), *extra) for h in range(6)]
            for name, extra in (("deltas", ()), ("full", ("--config", str(full))))}
    for run in runs["deltas"] + runs["full"]:
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return root, data, runs


def test_a_base_and_five_deltas_rebuild_the_model_trained_with_full_versions(six_hours, tmp_path):
    root, _, runs = six_hours
    deltas, full = root / "deltas", root / "full"
    kinds = [info(deltas, f"{v:06d}")["kind"] for v in range(1, 7)]
    assert kinds == ["full"] + ["delta"] * 5
    assert info(deltas, "000006")["chain"] == [f"{v:06d}" for v in range(1, 7)]
    assert {info(full, f"{v:06d}")["kind"] for v in range(4, 7)} == {"full"}
    # prune keeps 3 versions but never a version a kept delta is built on
    assert sorted(p.name for p in (deltas / "versions").iterdir()) == [f"{v:06d}" for v in range(1, 7)]
    assert sorted(p.name for p in (full / "versions").iterdir()) == ["000004", "000005", "000006"]
    assert "delta" in runs["deltas"][3].stdout and "of the table rows changed" in runs["deltas"][3].stdout
    assert records(deltas)[hour(3)]["publish"]["kind"] == "delta"

    # materialized: bitwise the model (and optimizer state) the full-version run published
    out = tmp_path / "materialized"
    materialize(deltas, "000006", out)
    built, reference = flat(read_full(out)), flat(read_full(full / "versions" / "000006"))
    assert built.keys() == reference.keys()
    tables = [k for k in built if "embedding_bags" in k]
    assert len(tables) >= 52  # 26 tables and their row-wise Adagrad state
    for key, value in built.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == reference[key].dtype and value.shape == reference[key].shape, key
            if key in tables:
                assert torch.equal(value, reference[key]), key
            else:
                assert torch.allclose(value, reference[key], rtol=0, atol=1e-6), key
        else:
            assert value == reference[key], key

    # what a serving process reads through current: the same model on both stores
    served, expected = load_current(deltas), load_current(full)
    assert served.version == expected.version == "000006" and served.info["kind"] == "delta"
    assert served.state_dict.keys() == expected.state_dict.keys()
    assert all(torch.equal(served.state_dict[k], expected.state_dict[k]) for k in served.state_dict)


def test_a_delta_holds_the_changed_rows_and_the_dense_part(six_hours):
    """Target: a delta <= 1.1 x the bytes of the rows the hour changed (the weights and their optimizer state) + the
    dense weights and Adam's two moments, met by the whole delta, its metadata (the job's id counts and run info)
    and the files' own encoding included; its table rows alone meet their 1.1x."""
    root, _, _ = six_hours
    deltas = root / "deltas"
    state = flat(read_full(deltas / "versions" / "000001", keys={"state_dict"}))
    dim = next(v.shape[1] for k, v in state.items() if "embedding_bags" in k)
    dense = sum(v.numel() * v.element_size() for k, v in state.items() if "embedding_bags" not in k)
    tables = sum(v.numel() * v.element_size() for k, v in state.items() if "embedding_bags" in k)
    for version in ("000002", "000004", "000006"):
        meta = info(deltas, version)
        folder = deltas / "versions" / version
        size = sum(f["bytes"] for f in meta["files"].values())
        assert {name: f["bytes"] for name, f in meta["files"].items()} == \
            {p.name: p.stat().st_size for p in folder.iterdir() if p.name != "info.json"}
        rows = meta["changed"]["changed_rows"]
        assert 0.02 < meta["changed"]["fraction"] < 0.6, meta["changed"]
        touched = rows * (dim * 4 + 4)  # fp32 row + its row-wise Adagrad value
        assert meta["files"]["rank00000.pt"]["bytes"] <= 1.1 * touched, (version, meta["files"], touched)
        part = unpack_tree(torch.load(folder / "dense.pt", weights_only=True))
        weights = sum(v.numel() * v.element_size() for v in part["dense"].values() if isinstance(v, torch.Tensor))
        assert weights <= 1.01 * dense
        moments = [v for s in part["meta"]["dense_optimizer"]["state"].values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.numel() > 1]
        assert sum(v.numel() * v.element_size() for v in moments) <= 2 * dense
        assert meta["files"]["rank00000.pt"]["bytes"] < 0.5 * tables
        # The whole delta, its metadata included
        assert size <= 1.1 * touched + 3 * dense, (version, size, touched, dense, meta["files"])


def test_the_cli_rebuilds_a_version_and_refuses_to_overwrite(six_hours, tmp_path):
    from disttrain.cli import main

    root, _, _ = six_hours
    out = tmp_path / "v3"
    assert main(["recsys", "materialize", "000003", "--model-root", str(root / "deltas"), "--out", str(out)]) == 0
    rebuilt = flat(read_full(out, keys={"state_dict"}))
    chain, _ = read_version(ModelStore(root / "deltas"), "000003", keys={"state_dict"})
    assert all(torch.equal(rebuilt[k], v) for k, v in flat(chain).items())
    assert json.loads((out / "info.json").read_text())["materialized_from"] == ["000001", "000002", "000003"]
    assert main(["recsys", "materialize", "000003", "--model-root", str(root / "deltas"), "--out", str(out)]) == 1
    assert main(["recsys", "materialize", "000042", "--model-root", str(root / "deltas"), "--out",
                 str(tmp_path / "x")]) == 1


def test_a_damaged_delta_is_refused_in_one_line(six_hours, tmp_path):
    root, data, _ = six_hours
    models = tmp_path / "models"
    shutil.copytree(root / "deltas", models, symlinks=True)
    target = models / "versions" / "000006" / "rank00000.pt"
    target.write_bytes(target.read_bytes()[:-10] + b"0123456789")
    error = the_error(run_daily(data, models, *HOURLY, "--force", "--run-date", hour(5)))
    assert "000006" in error and "rank00000.pt does not match the sha256" in error and "materialize" in error


def test_hour_files_are_checked_like_days(tmp_path):
    data, models = tmp_path / "data", tmp_path / "models"
    make_days(data, 4, 400, every="1h")
    (data / f"day_{hour(2)}.tsv").unlink()
    error = the_error(run_daily(data, models, *HOURLY))
    assert f"day {hour(2)} is missing" in error and "--skip-missing-days" in error
    error = the_error(run_daily(data, models, *HOURLY, "--run-date", "2026-11-01"))
    assert "is a day but the job runs every hour" in error
    error = the_error(run_daily(data, models, "--logger", "none"))
    assert "no day_YYYY-MM-DD.tsv[.gz] files" in error and "pass --every 1h" in error


@pytest.mark.slow
def test_a_kill_during_a_delta_publish_leaves_current_on_the_previous_version(six_hours, tmp_path):
    root, data, _ = six_hours
    models = tmp_path / "models"
    assert run_daily(data, models, *HOURLY, "--run-date", hour(0)).returncode == 0
    first = load_current(models)
    for crash_at, h in (("after-delta-files", 1), ("before-pointer", 1)):
        killed = daily(data, models, *HOURLY, "--run-date", hour(h), crash_at=crash_at)
        assert killed.returncode != 0 and "published version" not in killed.stdout
        now = load_current(models)  # the previous version, whole
        assert now.version == "000001" and all(torch.equal(now.state_dict[k], v) for k, v in first.state_dict.items())
    assert not (models / "work").exists()  # a delta's last period is not saved to work/ (trained again)
    again = run_daily(data, models, *HOURLY, "--run-date", hour(1))
    # the leftover of the kill before the pointer swap is removed; its number is not given to another model
    assert again.returncode == 0 and "removed version(s) 000002" in again.stdout, again.stdout[-2000:]
    assert "published version 000003" in again.stdout and load_current(models).version == "000003"
    assert info(models, "000003")["kind"] == "delta" and info(models, "000003")["chain"] == ["000001", "000003"]
    assert sorted(p.name for p in (models / "versions").iterdir()) == ["000001", "000003"]
    # the same model the uninterrupted run published
    expected, _ = read_version(ModelStore(root / "deltas"), "000002", keys={"state_dict"})
    assert all(torch.equal(load_current(models).state_dict[k], v) for k, v in expected["state_dict"].items())

    # ended after the pointer swap but before its records: the next run writes them from the version's info.json
    ended = daily(data, models, *HOURLY, "--run-date", hour(2), crash_at="before-records")
    assert ended.returncode == 86 and load_current(models).version == "000004"
    assert hour(2) not in records(models)
    again = run_daily(data, models, *HOURLY, "--run-date", hour(2))
    assert again.returncode == 0 and "stopped before its records; writing them" in again.stdout, again.stdout[-2000:]
    assert records(models)[hour(2)]["version"] == "000004" and load_current(models).version == "000004"


READER = """
import hashlib, sys, time
from pathlib import Path
from disttrain.recsys.delta import load_current
root, out, stop = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
with open(out, "w") as f:
    while not stop.exists():
        model = load_current(root)
        digest = hashlib.sha256()
        for key in sorted(model.state_dict):
            digest.update(key.encode() + model.state_dict[key].numpy().tobytes())
        f.write(f"{model.version} {digest.hexdigest()}\\n")
        f.flush()
"""


def digest_of(store: ModelStore, version: str) -> str:
    state, _ = read_version(store, version, keys={"state_dict"})
    digest = hashlib.sha256()
    for key in sorted(state["state_dict"]):
        digest.update(key.encode() + state["state_dict"][key].numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.slow
def test_a_reader_polling_current_during_20_publishes_never_reads_a_mixed_version(tmp_path):
    data, models = tmp_path / "data", tmp_path / "models"
    make_days(data, 21, 400, every="1h", start=dt.date(2026, 11, 1))
    config = write_config(tmp_path / "c.yaml", daily={"full_every": 4, "keep_versions": 50})
    args = (*HOURLY, "--config", str(config), "--min-auc", "0")  # 400-row hours: the AUC of 40 rows is noise
    assert run_daily(data, models, *args, "--run-date", hour(0)).returncode == 0
    out, stop = tmp_path / "reads.txt", tmp_path / "stop"
    reader = subprocess.Popen([sys.executable, "-c", READER, str(models), str(out), str(stop)], env=child_env(),
                              cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        # the publishes start once the reader reads (a fresh interpreter's imports take a loaded machine a while)
        deadline = time.monotonic() + 300
        while not (out.is_file() and out.read_text()) and reader.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert out.is_file() and out.read_text(), "the reader read nothing"
        for h in range(1, 21):
            run = run_daily(data, models, *args, "--run-date", f"2026-11-01_{h:02d}")
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    finally:
        stop.touch()
        _, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err[-3000:]
    reads = [line.split() for line in out.read_text().splitlines()]
    store = ModelStore(models)
    seen = {version for version, _ in reads}
    assert len(seen) >= 10, seen  # the reader kept up with the publishes
    truth = {version: digest_of(store, version) for version in seen}
    assert all(digest == truth[version] for version, digest in reads)
    kinds = {info(models, v)["kind"] for v in seen}
    assert kinds == {"full", "delta"}, kinds


@pytest.mark.slow
def test_deltas_written_by_two_processes_rebuild_their_model_and_warm_start_one(six_hours, tmp_path):
    """Two ranks each write the changed rows of their table shards; the delta equals a full version the same two
    ranks publish from the same start, and a one-process run warm-starts from the two-rank chain."""
    _, data, _ = six_hours
    models, full = tmp_path / "models", tmp_path / "full"
    torchrun = lambda where, *extra: run_torchrun(str(RECIPE.relative_to(ROOT)), "--data-root", str(data),  # noqa
                                                  "--model-root", str(where), "--accelerator", "cpu", *HOURLY,
                                                  *extra)
    first = torchrun(models, "--run-date", hour(0))
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.copytree(models, full, symlinks=True)
    second, reference = torchrun(models, "--run-date", hour(1)), torchrun(full, "--run-date", hour(1), "--full")
    assert second.returncode == reference.returncode == 0, second.stderr[-3000:] + reference.stderr[-3000:]
    assert sorted(info(models, "000002")["files"]) == ["dense.pt", "rank00000.pt", "rank00001.pt"]
    assert info(full, "000002")["kind"] == "full"
    rebuilt, _ = read_version(ModelStore(models), "000002")
    expected = flat(read_full(full / "versions" / "000002"))
    for key, value in flat(rebuilt).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, expected[key]), key
    one = run_daily(data, models, *HOURLY, "--run-date", hour(2))
    assert one.returncode == 0 and "current model 000002" in one.stdout, one.stdout[-2000:] + one.stderr[-2000:]
    assert load_current(models).version == "000003"


@pytest.mark.slow
def test_managed_id_tables_publish_deltas_that_rebuild_the_full_version_run_and_move_to_one_process(tmp_path):
    """Managed-collision tables on 2 processes: their remapping state (sorted raw ids, slots, counts) is sharded with
    the rows and changes with them; the 2-process chain of deltas rebuilds the full-version run bitwise. The next
    hour runs on 1 process, where which process holds an id, and in which row, differs: the job reads the chain in
    full, moves every held id to the one process, and publishes a full version equal bitwise to the one the
    full-version run publishes from its own full versions."""
    data = tmp_path / "data"
    make_days(data, 3, 1500, every="1h")
    stores = {}
    for name, versions in (("deltas", {}), ("full", {"full_every": 0})):
        config = write_config(tmp_path / f"{name}.yaml", model={"ids": "managed"}, daily=versions)
        models, args = tmp_path / name, (*HOURLY, "--min-auc", "0", "--config", str(config))
        for h in range(2):
            run = run_torchrun(str(RECIPE.relative_to(ROOT)), "--data-root", str(data), "--model-root",
                               str(models), "--accelerator", "cpu", *args, "--run-date", hour(h))
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        run = run_daily(data, models, *args, "--run-date", hour(2))
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        stores[name] = models
    deltas, full = stores["deltas"], stores["full"]
    assert info(deltas, "000002")["kind"] == "delta"
    assert sorted(info(deltas, "000002")["files"]) == ["dense.pt", "rank00000.pt", "rank00001.pt"]
    changed = info(deltas, "000002")["changed"]
    assert changed["table_rows"] == 26 * 1000 and 0 < changed["fraction"] < 1
    materialize(deltas, "000002", tmp_path / "built")
    for version, built in (("000002", read_full(tmp_path / "built")), ("000003", read_full(deltas / "versions" /
                                                                                          "000003"))):
        built, reference = flat(built), flat(read_full(full / "versions" / version))
        assert built.keys() == reference.keys() and any("_mch_sorted_raw_ids" in k for k in built), version
        for key, value in built.items():
            same = torch.equal(value, reference[key]) if isinstance(value, torch.Tensor) else value == reference[key]
            assert same, (version, key)
    # on 1 process the chain's layout no longer holds: the job published in full, from the chain read in full
    assert [info(deltas, v)["kind"] for v in ("000001", "000002", "000003")] == ["full", "delta", "full"]
    held = [v for k, v in flat(read_full(deltas / "versions" / "000003")).items() if k.endswith("_mch_sorted_raw_ids")]
    assert held and all(t.numel() > 0 for t in held)


def test_make_data_writes_hour_files(tmp_path):
    from disttrain.cli import main

    assert main(["recsys", "make-data", str(tmp_path), "--days", "3", "--rows", "50", "--every", "1h",
                 "--start", "2026-11-30"]) == 0
    assert sorted(os.listdir(tmp_path)) == [f"day_2026-11-30_{h:02d}.tsv" for h in range(3)]


def test_delta_files_pack_small_tensors_and_metadata_changes_round_trip():
    """What a delta file holds comes back as it went in: small tensors of every dtype (0-d, empty, bool, bf16) from
    the shared buffer, a large one from its own entry, plain values and tuples; metadata changes of an array with
    gaps too wide for 8 or 16 bits between them, none at all, or nearly all of it."""
    import io

    from disttrain.recsys.delta import CHANGED, diff_meta, pack_tree, patch_meta

    tree = {"a": torch.tensor(3.0), "b": [torch.zeros(0), torch.ones(2, 3, dtype=torch.bfloat16),
                                          torch.tensor([True, False])],
            "c": ("x", 1, None), "big": torch.arange(300_000, dtype=torch.int64), 0: {"lr": 0.5}}
    saved = io.BytesIO()
    torch.save(pack_tree(tree), saved)
    saved.seek(0)
    back = unpack_tree(torch.load(saved, weights_only=True))
    assert back.keys() == tree.keys() and back["c"] == tree["c"] and back[0] == tree[0]
    for got, want in [(back["a"], tree["a"]), (back["big"], tree["big"])] + list(zip(back["b"], tree["b"])):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert unpack_tree({"plain": 1}) == {"plain": 1}  # a file written before packing

    g = torch.Generator().manual_seed(0)
    base = {"seen": torch.randint(0, 255, (26, 131072), dtype=torch.uint8, generator=g),
            "owners": [torch.randint(-2 ** 31, 2 ** 31 - 1, (1000,), dtype=torch.int32, generator=g)] * 2,
            "moments": torch.randn(1000, generator=g)}
    now = {"seen": base["seen"].clone(), "owners": [base["owners"][0].clone(), base["owners"][1]],
           "moments": base["moments"] + 1}
    flat = now["seen"].view(-1)
    flat[[5, 70_000, 70_001, 3_400_000]] ^= 4  # gaps of 69,995 and 3.3M: bridged or stored wide
    now["owners"][0][torch.randperm(1000, generator=g)[:900]] += 1
    changes = diff_meta(now, base)
    assert isinstance(changes["moments"], torch.Tensor)  # changed everywhere: stored whole
    assert isinstance(changes["owners"][0], torch.Tensor)  # 90% changed: the changes would not be smaller
    assert changes["seen"][CHANGED]["count"] <= 4 + 2 * 2 ** 8 and changes["owners"][1][CHANGED]["count"] == 0
    saved = io.BytesIO()
    torch.save(pack_tree(changes), saved)
    assert saved.tell() < 12_000  # the seen bytes' 3.4 MB as a few hundred bytes
    saved.seek(0)
    rebuilt = patch_meta(base, unpack_tree(torch.load(saved, weights_only=True)))
    assert torch.equal(rebuilt["seen"], now["seen"]) and torch.equal(rebuilt["moments"], now["moments"])
    assert all(torch.equal(a, b) for a, b in zip(rebuilt["owners"], now["owners"]))
