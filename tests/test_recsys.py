"""DeepFM on torchrec: the FM term, data and metrics, the disttrain_recsys strategy on 1 and 2 CPU processes
(Trainer, Fabric, checkpoints, the guard of the other strategies), and the daily job end to end."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, child_env, run_dist

from disttrain.recsys.data import BadDataError, DayBatches, list_days, load_day, parse_day_file
from disttrain.recsys.metrics import ClickMetrics
from disttrain.recsys.model import DeepFMNet, fm_interaction
from disttrain.recsys.synthetic import make_days

RECIPE = ROOT / "recipes" / "recsys" / "deepfm_daily.py"


def test_fm_term_matches_pairwise_reference():
    fields = torch.randn(5, 7, 3, dtype=torch.float64)
    brute = torch.zeros(5, dtype=torch.float64)
    for i, j in itertools.combinations(range(7), 2):
        brute += (fields[:, i] * fields[:, j]).sum(-1)
    torch.testing.assert_close(fm_interaction(fields), brute)
    # per dimension: mixing dimensions (torchrec's FactorizationMachine) gives a different value
    mixed = 0.5 * (fields.sum((1, 2)) ** 2 - (fields.sum(2) ** 2).sum(1))
    assert not torch.allclose(mixed, brute)


def test_model_config_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"bottom_mlp=\[32\] must end with embedding_dim=16"):
        DeepFMNet(embedding_dim=16, num_embeddings_per_feature=[10] * 26, bottom_mlp=[32])
    from disttrain.parallel.recsys import RecsysOptions

    with pytest.raises(ValueError, match="sparse_optimizer='adam'"):
        RecsysOptions(sparse_optimizer="adam")
    with pytest.raises(ValueError, match="unknown sharding type 'rowwise'"):
        RecsysOptions(constraints={"t_cat_0": {"sharding_types": ["rowwise"]}})


def test_day_files_bad_rows_and_hashing(tmp_path):
    [path] = make_days(tmp_path, 1, 2000, bad_rows=10)
    labels, ints, cats, bad = parse_day_file(path)
    assert bad == 10 and len(labels) == 1990 and ints.shape == (1990, 13) and cats.shape == (1990, 26)
    day = load_day(path, tmp_path / "cache", max_bad_fraction=0.01)
    assert (day.rows, day.bad_rows) == (1990, 10)
    with pytest.raises(BadDataError, match=r"day_2026-11-01.tsv: 10 of 2000 rows are malformed"):
        load_day(path, tmp_path / "cache", max_bad_fraction=0.001)
    # gzip days read the same; hashing maps raw ids into each table
    gz = tmp_path / "gz" / "day_2026-11-02.tsv.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert list(list_days(gz.parent)) and load_day(gz, tmp_path / "cache2").rows == 1990
    dense, sparse, target = DayBatches(day, slice(0, 100), 64, [7] * 26)[0]
    assert sparse.shape == (64, 26) and int(sparse.max()) < 7 and dense.dtype == torch.float32
    np.testing.assert_array_equal(sparse.numpy(), day.sparse[:64] % 7)


def test_click_metrics_match_definitions():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(1000, generator=g), (torch.rand(1000, generator=g) < 0.3).float()
    metrics = ClickMetrics()
    for part in range(4):
        metrics.update(logits[part::4], labels[part::4])
    result = metrics.compute()
    p = torch.sigmoid(logits.double())
    logloss = torch.nn.functional.binary_cross_entropy(p, labels.double()).item()
    rate = labels.double().mean().item()
    entropy = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
    pos, neg = logits[labels == 1], logits[labels == 0]  # AUC = P(a positive outranks a negative)
    auc = (pos[:, None] > neg[None, :]).double().mean().item()
    assert result["auc"] == pytest.approx(auc, abs=1e-6)
    assert result["logloss"] == pytest.approx(logloss, rel=1e-9)
    assert result["ne"] == pytest.approx(logloss / entropy, rel=1e-9)
    assert result["calibration"] == pytest.approx(p.sum().item() / labels.sum().item(), rel=1e-9)
    assert result["rows"] == 1000


def test_registered_in_both_registries():
    import disttrain  # noqa: F401
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["disttrain_recsys"]["strategy"] is disttrain.strategies.RecsysStrategy
    assert STRATEGY_REGISTRY["disttrain_recsys"]["strategy"] is disttrain.fabric.RecsysStrategy
    with pytest.raises(TypeError, match="did you mean 'constraints'"):
        disttrain.strategies.RecsysStrategy(constraint={})


def test_other_strategies_refuse_torchrec_tables():
    """FSDP (in one process; DDP on two processes in the distributed test) names disttrain_recsys."""
    import lightning as L
    import torch.distributed as dist

    net = DeepFMNet(embedding_dim=8, num_embeddings_per_feature=[10] * 26, bottom_mlp=[8], deep_mlp=[8])
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="disttrain_fsdp")
    fabric.launch()
    try:
        with pytest.raises(TypeError, match="use strategy='disttrain_recsys'"):
            fabric.setup(net)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recsys_parity")
    [day] = make_days(folder / "data", 1, 20000)
    return {n: run_dist("recsys_run.py", folder / f"n{n}", str(day), nproc=n) for n in (1, 2)}


@pytest.mark.slow
def test_two_process_dmp_matches_one_process_auc(parity):
    one, two = parity[1][0], parity[2]
    assert one["metrics"]["auc"] > 0.65
    assert two[0]["metrics"] == two[1]["metrics"]  # metrics are reduced over ranks
    assert abs(two[0]["metrics"]["auc"] - one["metrics"]["auc"]) < 0.01, (one["metrics"], two[0]["metrics"])
    assert two[0]["metrics"]["rows"] == one["metrics"]["rows"] == 4000
    # the tables are sharded: each rank holds half of every table's rows, one process all of them
    for name, rows in one["local_rows"].items():
        assert two[0]["local_rows"][name] + two[1]["local_rows"][name] == rows


@pytest.mark.slow
def test_recsys_checkpoints_fabric_and_guard(parity):
    for rank in parity[2]:
        assert rank["restored"] == rank["metrics"] and rank["fused_equal"]  # shards + fused optimizer state
        assert "optimizer_states" in rank["meta_keys"] and rank["resumed_step"] == 3 * rank["steps"] // 2
        assert rank["loaded"] == rank["saved"] != rank["moved"] and rank["step_after_load"] == 6
        assert "t_cat_0  | table_wise" in rank["fabric_plan"]  # the per-table constraint was applied
        assert "disttrain_recsys" in rank["guard"] and "disttrain_ddp" in rank["guard"]


# -- the daily job --------------------------------------------------------------------------------------------
def daily(data: Path, models: Path, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in child_env().items()  # one process: no rendezvous left over from in-process tests
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    if crash_at:
        env["DISTTRAIN_DAILY_CRASH_AT"] = crash_at
    return subprocess.run([sys.executable, str(RECIPE), "--data-root", str(data), "--model-root", str(models),
                           "--accelerator", "cpu", *args], env=env, capture_output=True, text=True, timeout=900)


def records(models: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((models / "runs").glob("*.json"))}


def flip_training_labels(path: Path, eval_fraction: float = 0.1) -> None:
    """A corrupted export: the training rows' labels inverted (the held-out tail is left intact)."""
    lines = path.read_text().splitlines()
    cut = len(lines) - int(round(len(lines) * eval_fraction))
    flipped = [("1" if line[0] == "0" else "0") + line[1:] for line in lines[:cut]]
    path.write_text("\n".join(flipped + lines[cut:]) + "\n")


@pytest.mark.slow
def test_daily_job_catch_up_rerun_gate_crash_and_lock(tmp_path):
    data, models = tmp_path / "data", tmp_path / "models"
    make_days(data, 3, 20000)

    # catch-up: three unprocessed days trained in order, one publish
    first = daily(data, models)
    assert first.returncode == 0, first.stderr[-3000:]
    assert [line for line in first.stdout.splitlines() if "trained on" in line] == [
        f"[deepfm-daily] 2026-11-0{d}: trained on 18000 rows" for d in (1, 2, 3)]
    runs = records(models)
    assert sorted(runs) == ["2026-11-01", "2026-11-02", "2026-11-03"]
    assert {r["status"] for r in runs.values()} == {"published"} and runs["2026-11-03"]["version"] == "000001"
    assert runs["2026-11-03"]["metrics"]["auc"] > 0.70, runs["2026-11-03"]["metrics"]
    assert os.readlink(models / "current") == "versions/000001"

    # a re-run does nothing
    again = daily(data, models)
    assert again.returncode == 0 and "nothing to do" in again.stdout and "trained on" not in again.stdout
    assert records(models) == runs and sorted(p.name for p in (models / "versions").iterdir()) == ["000001"]

    # a corrupted day: trained, evaluated against the current model on the same rows, not published
    make_days(data, 1, 20000, start=_date("2026-11-04"), first_index=3)
    flip_training_labels(data / "day_2026-11-04.tsv")
    bad = daily(data, models)
    assert bad.returncode == 3, bad.stdout[-2000:] + bad.stderr[-2000:]
    assert "NOT published" in bad.stdout
    rejected = records(models)["2026-11-04"]
    assert rejected["status"] == "rejected" and rejected["version"] is None
    assert rejected["metrics"]["auc"] < rejected["current_metrics"]["auc"] - 0.005
    assert os.readlink(models / "current") == "versions/000001"

    # a crash after the first of two new days: the published model is untouched; the re-run resumes
    make_days(data, 2, 20000, start=_date("2026-11-05"), first_index=4)
    published = (models / "versions" / "000001" / "info.json").read_text()
    crashed = daily(data, models, crash_at="after-day-2026-11-05")
    assert crashed.returncode == 86 and "2026-11-05: trained" in crashed.stdout
    assert os.readlink(models / "current") == "versions/000001"
    assert (models / "versions" / "000001" / "info.json").read_text() == published
    resumed = daily(data, models)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout and "2026-11-05: trained" not in resumed.stdout
    assert "2026-11-06: trained" in resumed.stdout
    runs = records(models)
    assert runs["2026-11-05"]["status"] == runs["2026-11-06"]["status"] == "published"
    assert os.readlink(models / "current") == "versions/000002"
    info = json.loads((models / "versions" / "000002" / "info.json").read_text())
    assert info["days"] == ["2026-11-01", "2026-11-02", "2026-11-03", "2026-11-05", "2026-11-06"]
    assert not (models / "work").exists()

    # a crash between writing the new version and swapping the pointer: readers keep the old model; re-run ends
    crashed = daily(data, models, "--force", crash_at="before-pointer")
    assert crashed.returncode == 86 and os.readlink(models / "current") == "versions/000002"
    finished = daily(data, models, "--force")
    assert finished.returncode == 0 and "resuming" in finished.stdout and "trained on" not in finished.stdout
    assert os.readlink(models / "current") == "versions/000004"  # 000003 was never pointed at
    assert sorted(p.name for p in (models / "versions").iterdir()) == ["000002", "000003", "000004"]

    # clear failures: a running job's lock, a missing day, too many malformed rows
    from disttrain.recsys.publish import ModelStore

    with ModelStore(models).lock():
        locked = daily(data, models, "--force")
    assert locked.returncode == 1 and "another daily run holds" in locked.stderr
    missing = daily(data, models, "--run-date", "2026-12-25")
    assert missing.returncode == 1 and "no data for --run-date 2026-12-25" in missing.stderr
    make_days(data, 1, 2000, start=_date("2026-11-07"), first_index=6, bad_rows=100)
    malformed = daily(data, models)
    assert malformed.returncode == 1 and "day_2026-11-07.tsv: 100 of 2000 rows are malformed" in malformed.stderr
    assert os.readlink(models / "current") == "versions/000004"


def _date(text: str):
    import datetime as dt

    return dt.date.fromisoformat(text)


def test_deploy_files_run_the_daily_job():
    import ast

    import yaml

    deploy = ROOT / "deploy"
    cron = [line for line in (deploy / "crontab").read_text().splitlines() if line and not line.startswith("#")]
    assert len(cron) == 1 and len(cron[0].split()[:5]) == 5 and "recipes/recsys/deepfm_daily.py" in cron[0]
    service = (deploy / "systemd" / "deepfm-daily.service").read_text()
    assert "Type=oneshot" in service and "recipes/recsys/deepfm_daily.py" in service
    assert "OnCalendar=" in (deploy / "systemd" / "deepfm-daily.timer").read_text()
    job = yaml.safe_load((deploy / "kubernetes" / "deepfm-daily-cronjob.yaml").read_text())
    assert job["kind"] == "CronJob" and job["spec"]["concurrencyPolicy"] == "Forbid"
    container = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert "recipes/recsys/deepfm_daily.py" in container["command"]
    dag = ast.parse((deploy / "airflow" / "deepfm_daily_dag.py").read_text())
    assert any(isinstance(n, ast.Constant) and "deepfm_daily.py" in str(n.value) for n in ast.walk(dag))
    # the options the deploy files pass are the recipe's own
    from disttrain.recsys.daily import parser

    args = parser().parse_args(["--data-root", "/data/clicks", "--model-root", "/models/deepfm", "--run-date",
                                "2026-11-29"])
    assert str(args.run_date) == "2026-11-29"


@pytest.mark.slow
def test_daily_job_on_two_processes_warm_starts_from_sharded_version(tmp_path):
    """torchrun with 2 processes: the tables are sharded, partial batches are dropped or padded so every rank
    runs the same collectives, and the next day warm-starts from the 2-rank published checkpoint."""
    from conftest import free_port

    data, models = tmp_path / "data", tmp_path / "models"
    make_days(data, 1, 6000)
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])

    def torchrun() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                               "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(RECIPE),
                               "--data-root", str(data), "--model-root", str(models), "--accelerator", "cpu"],
                              env=env, capture_output=True, text=True, timeout=900)

    first = torchrun()
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in (models / "versions" / "000001").glob("*.distcp")) == ["__0_0.distcp",
                                                                                          "__1_0.distcp"]
    make_days(data, 1, 6000, start=_date("2026-11-02"), first_index=1)
    second = torchrun()
    assert second.returncode == 0, second.stderr[-3000:]
    assert "current model 000001" in second.stdout and "2026-11-02: trained on 5120 rows" in second.stdout
    assert records(models)["2026-11-02"]["metrics"]["rows"] == 600
