"""DeepFM on torchrec: the FM term, data and metrics, the disttrain_recsys strategy on 1 and 2 CPU processes
(Trainer, Fabric, checkpoints, the guard of the other strategies), and the daily job end to end."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, child_env, run_dist, run_python, run_torchrun

from disttrain.parallel.families.deepfm import DeepFMNet, fm_interaction
from disttrain.recsys.data import BadDataError, DayBatches, day_stats, list_days, load_day, parse_day_file
from disttrain.recsys.metrics import ClickMetrics
from disttrain.recsys.publish import ModelStore
from disttrain.recsys.synthetic import make_days
from disttrain.recsys.validate import ValidationBounds, check_day

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
    from disttrain.parallel.engines.recsys import RecsysOptions

    with pytest.raises(ValueError, match="sparse_optimizer='adam'"):
        RecsysOptions(sparse_optimizer="adam")
    with pytest.raises(ValueError, match="unknown sharding type 'rowwise'"):
        RecsysOptions(constraints={"t_cat_0": {"sharding_types": ["rowwise"]}})


def test_day_files_bad_rows_and_hashing(tmp_path):
    [path] = make_days(tmp_path, 1, 2000, bad_rows=10)
    parsed = parse_day_file(path)
    assert parsed.bad_rows == 10 and len(parsed.labels) == 1990 and parsed.ints.shape == (1990, 13)
    assert parsed.cats.shape == (1990, 26) and len(parsed.bad_examples) == 3
    day = load_day(path, tmp_path / "cache", max_bad_fraction=0.01)
    assert (day.rows, day.bad_rows) == (1990, 10)
    with pytest.raises(BadDataError, match=r"day_2026-11-01.tsv: 10 of 2000 rows are malformed .*; line \d+: 37"
                                           r" tab-separated fields instead of 40; line \d+: C26 holds 'not-hex!'"):
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
    """The daily job in one process (as cron starts it), forked from a pre-imported zygote."""
    return run_python(str(RECIPE), "--data-root", str(data), "--model-root", str(models), "--accelerator", "cpu",
                      *args, env={"DISTTRAIN_DAILY_CRASH_AT": crash_at} if crash_at else None)


def records(models: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((models / "runs").glob("*.json"))}


def rewrite_training_labels(path: Path, how: str, eval_fraction: float = 0.1) -> None:
    """A corrupted export: the training rows' labels inverted ("flip": the click rate jumps) or shuffled among them
    ("shuffle": the click rate and every feature look normal, the labels carry no signal); the held-out tail is
    left intact."""
    lines = path.read_text().splitlines()
    cut = len(lines) - int(round(len(lines) * eval_fraction))
    labels = [line[0] for line in lines[:cut]]
    if how == "flip":
        labels = ["1" if label == "0" else "0" for label in labels]
    else:
        np.random.default_rng(0).shuffle(labels)
    path.write_text("\n".join([label + line[1:] for label, line in zip(labels, lines[:cut])] + lines[cut:]) + "\n")


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

    # shuffled labels look normal (flipped ones stop at validation: test_job_stops_on_a_day_that_fails_validation):
    # trained, evaluated against the current model on the same rows, not published
    make_days(data, 1, 20000, start=_date("2026-11-04"), first_index=3)
    rewrite_training_labels(data / "day_2026-11-04.tsv", "shuffle")
    bad = daily(data, models)
    assert bad.returncode == 3, bad.stdout[-2000:] + bad.stderr[-2000:]
    assert "NOT published: AUC" in bad.stdout
    rejected = records(models)["2026-11-04"]
    assert rejected["status"] == "rejected" and rejected["version"] is None
    assert rejected["reason"].startswith(f"AUC {rejected['metrics']['auc']:.4f} < current")
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

    # a crash between writing the new version and swapping the pointer: readers keep the old model; the re-run
    # removes the version that was never made current (it would count toward keep_versions), says so, and ends
    crashed = daily(data, models, "--force", crash_at="before-pointer")
    assert crashed.returncode == 86 and os.readlink(models / "current") == "versions/000002"
    assert (models / "versions" / "000003" / "info.json").is_file()
    finished = daily(data, models, "--force")
    assert finished.returncode == 0 and "resuming" in finished.stdout and "trained on" not in finished.stdout
    assert "removed version(s) 000003: complete but never made current" in finished.stdout
    assert os.readlink(models / "current") == "versions/000004"  # a number is never reused
    # keep_versions=3 keeps three real versions: the leftover no longer pushes 000001 out
    assert sorted(p.name for p in (models / "versions").iterdir()) == ["000001", "000002", "000004"]
    assert records(models)["2026-11-06"]["removed_versions"] == ["000003"]
    # a crash after the pointer swap but before the records (the run's work/staging still there): the next run
    # writes the records from the version's info.json and trains nothing
    make_days(data, 1, 20000, start=_date("2026-11-07"), first_index=6)
    crashed = daily(data, models, crash_at="before-records")
    assert crashed.returncode == 86 and os.readlink(models / "current") == "versions/000005"
    assert "2026-11-07" not in records(models) and (models / "work").exists()
    recovered = daily(data, models)
    assert recovered.returncode == 0, recovered.stderr[-3000:]
    assert "published 000005 but stopped before its records; writing them" in recovered.stdout
    assert "trained on" not in recovered.stdout and "nothing to do" in recovered.stdout
    assert records(models)["2026-11-07"]["version"] == "000005" and not (models / "work").exists()

    # clear failures: a running job's lock, a missing day, too many malformed rows
    from disttrain.recsys.publish import ModelStore

    with ModelStore(models).lock():
        locked = daily(data, models, "--force")
    assert locked.returncode == 1 and "another daily run holds" in locked.stderr
    missing = daily(data, models, "--run-date", "2026-12-25")
    assert missing.returncode == 1 and "no data for --run-date 2026-12-25" in missing.stderr
    make_days(data, 1, 2000, start=_date("2026-11-08"), first_index=7, bad_rows=100)
    malformed = daily(data, models)
    assert malformed.returncode == 1 and "day_2026-11-08.tsv: 100 of 2000 rows are malformed" in malformed.stderr
    assert os.readlink(models / "current") == "versions/000005"


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
    data, models = tmp_path / "data", tmp_path / "models"
    make_days(data, 1, 6000)
    torchrun = lambda: run_torchrun(str(RECIPE.relative_to(ROOT)), "--data-root", str(data),  # noqa: E731
                                    "--model-root", str(models), "--accelerator", "cpu")

    first = torchrun()
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in (models / "versions" / "000001").glob("*.distcp")) == ["__0_0.distcp",
                                                                                          "__1_0.distcp"]
    make_days(data, 1, 6000, start=_date("2026-11-02"), first_index=1)
    second = torchrun()
    assert second.returncode == 0, second.stderr[-3000:]
    assert "current model 000001" in second.stdout and "2026-11-02: trained on 5120 rows" in second.stdout
    assert records(models)["2026-11-02"]["metrics"]["rows"] == 600
    # the console holds the job's lines, once (rank 0); each rank keeps its library output in a file of its own
    assert first.stderr == second.stderr == "", first.stderr[-3000:] + second.stderr[-3000:]
    assert all(line.startswith("[deepfm-daily] ") for line in first.stdout.splitlines() + second.stdout.splitlines())
    assert second.stdout.count("published version 000002") == 1
    logs: dict[str, str] = {}  # rank 0's file and rank 1's (two of each if the runs straddled midnight UTC)
    for path in sorted((models / "logs").glob("job-*.log")):
        rank = "rank1" if path.name.endswith(".rank1.log") else "rank0"
        logs[rank] = logs.get(rank, "") + path.read_text()
    assert sorted(logs) == ["rank0", "rank1"] and logs["rank0"].count(" run started: ") == 2
    assert all(line.split()[1] == "rank1" for line in logs["rank1"].splitlines() if not line.startswith("    "))


def cron(data: Path, models: Path, *args: str) -> subprocess.CompletedProcess:
    """The daily job as cron starts it: a fresh interpreter with Python's default warning filters (processes
    forked from the zygote inherit the tests' PYTHONWARNINGS=ignore, which would hide what the job must route)."""
    import sys

    env = {k: v for k, v in child_env().items() if k != "PYTHONWARNINGS"}
    return subprocess.run([sys.executable, str(RECIPE), "--data-root", str(data), "--model-root", str(models),
                           "--accelerator", "cpu", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


def job_log_runs(models: Path) -> list[list[str]]:
    """The runs in MODEL_ROOT/logs/job-*.log (rank 0), each as its entries (a continuation line joined to its
    entry), in the order they ran."""
    runs: list[list[str]] = []
    for path in sorted(p for p in (models / "logs").glob("job-*.log") if ".rank" not in p.name):
        for line in path.read_text().splitlines():
            if line.startswith("    "):
                runs[-1][-1] += "\n" + line
            elif " run started: " in line:
                runs.append([line])
            else:
                runs[-1].append(line)
    return runs


@pytest.mark.slow
def test_daily_job_prints_its_own_lines_and_logs_library_warnings_once(tmp_path):
    """cron mails what the job prints: its own lines, and the warnings of disttrain's own code (a model without
    checksums); the libraries' warnings and log records go to MODEL_ROOT/logs/job-DAY.log, once each per run."""
    data, models = tmp_path / "data", tmp_path / "models"
    make_days(data, 1, 2000)
    first = daily(data, models)  # the model to warm-start from (forked from the zygote: its warnings filtered out)
    assert first.returncode == 0 and first.stderr == "", first.stderr[-3000:]
    make_days(data, 2, 2000, start=_date("2026-11-02"), first_index=1)
    (models / "versions" / "000001" / "manifest.json").unlink()  # written before checksums: loaded unverified

    run = cron(data, models)  # a warm start (DCP loads into torchrec's tables), then two days: two Trainers
    assert run.returncode == 0, run.stderr[-3000:]
    [line] = run.stderr.splitlines()
    assert "UnverifiedCheckpointWarning: checkpoint" in line and "versions/000001' has no manifest.json" in line
    assert run.stdout.splitlines()[0] == "[deepfm-daily] run 2026-11-03: days ['2026-11-02', '2026-11-03']"
    assert all(line.startswith("[deepfm-daily] ") for line in run.stdout.splitlines()), run.stdout
    assert "current model 000001" in run.stdout and "published version 000002" in run.stdout

    runs = job_log_runs(models)
    assert len(runs) == 2 and all(r[-1].split(" ", 4)[2:4] == ["run", "ended:"] for r in runs), runs
    entries = runs[1]
    library = [entry for entry in entries if entry.split()[2] not in ("run", "INFO") or " INFO lightning." in entry]
    messages = [entry.split(" ", 2)[2] for entry in library]  # without the time: what is said, by whom
    assert len(messages) == len(set(messages)), messages  # once each, although each Trainer says it again
    assert not any("deprecating ShardedTensor" in entry for entry in entries)  # no deprecated use of ours left
    text = "\n".join(entries)
    for kind, where, said in [("FutureWarning", "torchrec/distributed/planner/planners.py", "HeuristicalStorage"),
                              ("INFO", "lightning.pytorch.utilities.rank_zero", "GPU available: False"),
                              ("INFO", "lightning.pytorch.utilities.rank_zero", "Tip: For seamless cloud logging"),
                              ("PossibleUserWarning", "lightning/pytorch/trainer/configuration_validator.py",
                               "no `val_dataloader`"),
                              ("UnverifiedCheckpointWarning", "disttrain/parallel/", "has no manifest.json")]:
        assert len(re.findall(rf"rank0 {kind} {re.escape(where)}\S*( \S+)?: .*{re.escape(said)}", text)) == 1, said
    assert re.search(r"rank0 INFO disttrain.recsys.daily \S+: 2026-11-03: train 4/4 ", text)  # progress lines


# -- the daily job's safeguards, in this process (one interpreter, tiny days) -----------------------------------
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_daily(data: Path, models: Path, *args: str) -> subprocess.CompletedProcess:
    """The recipe's main() in this process (no interpreter start: a tiny day takes about a second), with its
    exit status, stdout and stderr as a subprocess would give them. The environment is left as it was found, as a
    subprocess leaves it: the job's ``seed_everything`` sets PL_GLOBAL_SEED, which would otherwise send the test's
    later launches to fresh interpreters (the zygotes serve only the environment they started in)."""
    import contextlib
    import io
    import warnings

    from disttrain.recsys.daily import main

    argv = ["--data-root", str(data), "--model-root", str(models), "--accelerator", "cpu", *args]
    saved = dict(os.environ)
    for key in DIST_ENV:  # one process, not an outer launcher's
        os.environ.pop(key, None)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # library deprecation notices, not the job's output
            code = main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def write_config(path: Path, **changes: dict) -> Path:
    """deepfm_tiny.yaml with ``changes`` merged into its sections (e.g. daily={"min_auc": 0.9})."""
    import yaml

    recipe = yaml.safe_load((ROOT / "configs" / "recsys" / "deepfm_tiny.yaml").read_text())
    for section, values in changes.items():
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(recipe[section].get(key), dict):
                recipe[section][key].update(value)
            else:
                recipe[section][key] = value
    path.write_text(yaml.safe_dump(recipe))
    return path


def the_error(run: subprocess.CompletedProcess) -> str:
    """The one line a failed run prints (asserting that it is one line, with no traceback)."""
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("deepfm_daily.py: error: "), run.stderr[-3000:]
    return lines[0][len("deepfm_daily.py: error: "):]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A model root with version 000001 trained on two 1000-row days (01, 02); tests copy it before changing it."""
    root = tmp_path_factory.mktemp("published")
    make_days(root / "data", 2, 1000)
    run = run_daily(root / "data", root / "models")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return root


def copy_of(published: Path, tmp_path: Path) -> tuple[Path, Path]:
    import shutil

    shutil.copytree(published, tmp_path / "root", symlinks=True)
    return tmp_path / "root" / "data", tmp_path / "root" / "models"


def test_gate_refuses_nonfinite_models_and_first_models_below_the_floor():
    from disttrain.recsys.daily import rejection

    good, nan = {"auc": 0.70, "logloss": 0.5}, {"auc": 0.70, "logloss": float("nan")}
    assert rejection(good, None, None, 0.005, 0.55) is None
    assert rejection(good, {"auc": 0.702}, None, 0.005, 0.55) is None
    assert rejection(good, {"auc": 0.71}, None, 0.005, 0.55) == "AUC 0.7000 < current 0.7100 - auc_tolerance 0.005"
    assert rejection(good, None, None, 0.005, 0.75) == \
        "AUC 0.7000 < daily.min_auc 0.75 (a first model has no current model to compare with)"
    assert rejection(nan, None, None, 0.005, 0.55) == "non-finite metrics (logloss nan)"
    assert rejection(good, None, ("2026-11-02", "3 of 9 values are non-finite"), 0.005, 0.55) == \
        "training diverged on 2026-11-02: 3 of 9 values are non-finite; lower train.lr or model.sparse_optimizer.lr"


def test_diverged_run_is_rejected_and_recorded(tmp_path):
    data, models = tmp_path / "data", tmp_path / "models"
    make_days(data, 2, 1000)
    config = write_config(tmp_path / "diverge.yaml", model={"sparse_optimizer": {"lr": 1e30}})
    run = run_daily(data, models, "--config", str(config))
    assert run.returncode == 3, run.stdout[-2000:] + run.stderr[-2000:]
    assert "2026-11-01: training diverged" in run.stdout and "2026-11-02: trained" not in run.stdout
    record = records(models)["2026-11-02"]
    assert record["status"] == "rejected" and record["version"] is None and record["trained_days"] == []
    assert record["reason"].startswith("training diverged on 2026-11-01: ")
    assert "values are non-finite" in record["reason"] and record["metrics"]["logloss"] == "nan"
    assert json.loads((models / "runs" / "2026-11-02.json").read_text(), parse_constant=pytest.fail)
    assert not (models / "current").exists() and not list(models.glob("versions/*"))
    assert not (models / "work").exists()  # nothing of the diverged model is kept for a resume


def test_first_model_must_clear_the_auc_floor(tmp_path):
    data, models = tmp_path / "data", tmp_path / "models"
    make_days(data, 1, 1000)
    run = run_daily(data, models, "--min-auc", "0.99")
    assert run.returncode == 3 and not (models / "current").exists()
    record = records(models)["2026-11-01"]
    assert record["reason"] == (f"AUC {record['metrics']['auc']:.4f} < daily.min_auc 0.99 (a first model has no"
                                " current model to compare with)")


def test_warm_start_refuses_a_current_model_with_nan_weights(published, tmp_path):
    """A current model with NaN rows in one table (published before the gate, or damaged) is not trained from."""
    import shutil

    import torch.distributed as dist

    from disttrain.parallel.engines.recsys import RecsysEngine, RecsysOptions
    from disttrain.recsys.daily import DEFAULT_CONFIG, init_processes, load_recipe
    from disttrain.recsys.model import DeepFM

    data, models = copy_of(published, tmp_path)
    version = models / "versions" / "000001"
    saved = {k: os.environ.pop(k) for k in DIST_ENV if k in os.environ}
    init_processes("cpu")
    try:
        module = DeepFM(load_recipe(DEFAULT_CONFIG)["model"])
        engine = RecsysEngine(RecsysOptions())
        engine.parallelize(module, torch.device("cpu"))
        metadata = engine.load(version, module)
        table = module.state_dict()["net.ebc.embedding_bags.t_cat_3.weight"]
        with torch.no_grad():
            table.local_shards()[0].tensor[:10] = float("nan")  # the shard is a view of the table's rows
        engine.save(tmp_path / "poisoned", module, metadata)
    finally:
        dist.destroy_process_group()
        os.environ.update(saved)
    shutil.copy(version / "info.json", tmp_path / "poisoned")
    shutil.rmtree(version)
    (tmp_path / "poisoned").rename(version)

    make_days(data, 1, 1000, start=_date("2026-11-03"), first_index=2)
    assert the_error(run_daily(data, models)) == (
        f"{version} has non-finite weights (160 of 446,815 values are non-finite, in 1 of 38 tensors (the most in"
        " net.ebc.embedding_bags.t_cat_3.weight)); training from it would only spread them: point current at an"
        f" earlier version (ln -sfn versions/NNNNNN {models / 'current'}) or remove {models / 'current'} to train"
        " from scratch")
    assert os.readlink(models / "current") == "versions/000001" and "2026-11-03" not in records(models)


def test_bad_day_files_name_the_file_and_line(tmp_path):
    [path] = make_days(tmp_path / "data", 1, 1000)
    lines = path.read_text().splitlines()
    fields = lines[4].split("\t")
    fields[3] = "99999999999999999999"  # I3 beyond int64
    lines[4] = "\t".join(fields)
    fields = lines[6].split("\t")
    fields[14:16] = ["ffffffffffffffff", "8000000000000000"]  # C1, C2: 64-bit hashed ids
    lines[6] = "\t".join(fields)
    path.write_text("\n".join(lines) + "\n")
    day = load_day(path, tmp_path / "cache")
    assert (day.rows, day.bad_rows, day.bad_examples) == (999, 1, ("line 5: I3 value 99999999999999999999 is beyond"
                                                                    " int64",))
    with pytest.raises(BadDataError) as error:
        load_day(path, tmp_path / "cache", max_bad_fraction=0.0)
    assert str(error.value) == (
        "day_2026-11-01.tsv: 1 of 1000 rows are malformed (0.10% > max_bad_fraction=0.00%; line 5: I3 value"
        " 99999999999999999999 is beyond int64); fix or replace the file, or raise the threshold (--max-bad-fraction)"
        " if the rows can be dropped")
    # 64-bit ids are hashed into the tables as unsigned numbers, not overflowed
    _, sparse, _ = DayBatches(day, slice(0, 10), 10, [1000] * 26)[0]
    assert sparse[5, :2].tolist() == [0xFFFFFFFFFFFFFFFF % 1000, 0x8000000000000000 % 1000]

    import shutil

    gz = tmp_path / "gz" / "day_2026-11-02.tsv.gz"
    gz.parent.mkdir()
    packed = gzip.compress(path.read_bytes())
    cases = {packed[: len(packed) // 2]: r"day_2026-11-02.tsv.gz is truncated after line \d+ \(Compressed file ended"
                                         r" before the end-of-stream marker was reached\); copy the file again from"
                                         r" its source",
             b"label\tI1\n": r"day_2026-11-02.tsv.gz is not a gzip file \(Not a gzipped file \(b'la'\)\); copy it"
                             r" again from its source \(or name it .tsv if it is plain text\)",
             packed[:-8] + bytes(8): r"day_2026-11-02.tsv.gz is corrupt after line 1000 \(CRC check failed"}
    for content, message in cases.items():
        gz.write_bytes(content)
        shutil.rmtree(tmp_path / "cache-gz", ignore_errors=True)
        with pytest.raises(BadDataError, match=f"^{message}"):
            load_day(gz, tmp_path / "cache-gz")
    empty = tmp_path / "gz" / "day_2026-11-03.tsv"
    empty.write_text("")
    with pytest.raises(BadDataError) as error:
        load_day(empty, tmp_path / "cache-gz")
    assert str(error.value) == ("day file day_2026-11-03.tsv is empty (no rows); replace it with the day's export, or"
                                " remove it and rerun with --skip-missing-days to go on without that day")


def test_job_failures_are_one_line(published, tmp_path):
    import shutil

    data, models = copy_of(published, tmp_path)
    # a day too small for a held-out split
    make_days(data, 1, 5, start=_date("2026-11-03"), first_index=2)
    assert the_error(run_daily(data, models)) == (
        "day_2026-11-03.tsv has 5 rows, so its held-out share (daily.eval_fraction=0.1) is empty and the new model"
        " cannot be evaluated; is the export complete? Rerun when the whole day has arrived, or raise"
        " daily.eval_fraction")
    # an empty day file, a truncated .gz
    (data / "day_2026-11-03.tsv").write_text("")
    assert the_error(run_daily(data, models)).startswith("day file day_2026-11-03.tsv is empty (no rows)")
    (data / "day_2026-11-03.tsv").unlink()
    packed = gzip.compress((published / "data" / "day_2026-11-02.tsv").read_bytes())
    (data / "day_2026-11-03.tsv.gz").write_bytes(packed[: len(packed) // 2])
    assert the_error(run_daily(data, models)).startswith("day_2026-11-03.tsv.gz is truncated after line ")
    (data / "day_2026-11-03.tsv.gz").unlink()
    # a corrupt table shard in the current model: one line; --verbose adds the traceback
    make_days(data, 1, 1000, start=_date("2026-11-03"), first_index=2)
    shard = models / "versions" / "000001" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    version, current = models / "versions" / "000001", models / "current"
    error = the_error(run_daily(data, models))
    assert error.startswith(f"{version} cannot be loaded: checkpoint '{version}' is corrupt")
    assert error.endswith(f"; point current at an earlier version (ln -sfn versions/NNNNNN {current}) or remove"
                          f" {current} to train from scratch")
    verbose = run_daily(data, models, "--verbose")  # the job log's lines too, then the error and its traceback
    lines = verbose.stderr.splitlines()
    assert verbose.returncode == 1 and lines.count(f"deepfm_daily.py: error: {error}") == 1, verbose.stderr[-3000:]
    assert lines[lines.index(f"deepfm_daily.py: error: {error}") + 1] == "Traceback (most recent call last):"
    shutil.rmtree(models / "versions" / "000001")
    assert the_error(run_daily(data, models)).startswith(f"{current} points at {version}, which does not exist")


def test_missing_day_stops_or_is_skipped_and_late_days_wait(tmp_path):
    data, models = tmp_path / "data", tmp_path / "models"
    make_days(data, 2, 1000)
    make_days(data, 1, 1000, start=_date("2026-11-04"), first_index=3)
    assert the_error(run_daily(data, models)) == (
        f"day 2026-11-03 is missing: no day_2026-11-03.tsv[.gz] in {data} although later days are there; days are"
        " trained in order, so wait for it, or pass --skip-missing-days (daily.skip_missing_days: true) to go on"
        " without it (recorded as skipped)")
    assert not (models / "current").exists()

    skip = write_config(tmp_path / "skip.yaml", daily={"skip_missing_days": True})  # the config key
    run = run_daily(data, models, "--config", str(skip))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "skipping missing day(s) 2026-11-03" in run.stdout
    runs = records(models)
    assert runs["2026-11-03"]["status"] == "skipped" and runs["2026-11-04"]["skipped_days"] == ["2026-11-03"]
    assert json.loads((models / "versions" / "000001" / "info.json").read_text())["days"] == [
        "2026-11-01", "2026-11-02", "2026-11-04"]
    assert run_daily(data, models).returncode == 0  # recorded: no longer a gap, even without the option

    # 03 arrives after 04 is in the model: not trained on top of it, recorded as late, unless asked
    make_days(data, 1, 1000, start=_date("2026-11-03"), first_index=2)
    late = run_daily(data, models)
    assert late.returncode == 0 and "trained on" not in late.stdout
    assert "not training 2026-11-03: older than 2026-11-04, the newest day in the current model" in late.stdout
    assert records(models)["2026-11-03"]["status"] == "late"
    asked = run_daily(data, models, "--train-late-days")  # the command-line flag
    assert asked.returncode in (0, 3) and "2026-11-03: trained on 900 rows" in asked.stdout
    assert records(models)["2026-11-03"]["status"] in ("published", "rejected")


def test_validation_passes_normal_drift_and_stops_broken_days(tmp_path):
    """Four normal days pass against the days before them; a day with flipped labels, a column gone missing, a
    new id vocabulary or a rescaled integer column stops at the statistic that moved."""
    paths = make_days(tmp_path / "data", 5, 1000)
    stats = [day_stats(p, tmp_path / "cache") for p in paths]
    bounds = ValidationBounds()
    for k in range(1, 5):
        assert check_day(stats[k], stats[:k], bounds) is None

    def broken(name: str, change) -> dict:
        rows = [line.split("\t") for line in paths[4].read_text().splitlines()]
        for fields in rows:
            change(fields)
        path = tmp_path / name / paths[4].name
        path.parent.mkdir()
        path.write_text("\n".join("\t".join(fields) for fields in rows) + "\n")
        return day_stats(path, tmp_path / f"cache-{name}")

    def flip(fields):
        fields[0] = "1" if fields[0] == "0" else "0"

    def blank(fields):
        fields[14 + 6] = ""  # C7

    def rehash(fields):
        fields[14:] = [f"{int(x, 16) ^ 0x5BD1E995:08x}" if x else x for x in fields[14:]]

    def rescale(fields):
        fields[2] = str(int(fields[2]) * 1000) if fields[2] else ""  # I2 in other units

    for name, change, statistic in (("flip", flip, "label_rate"), ("blank", blank, "missing_rate[C7]"),
                                    ("rehash", rehash, "id_overlap[C1]"), ("rescale", rescale, "dense_mean[I2]")):
        finding = check_day(broken(name, change), stats[:4], bounds)
        assert finding is not None and finding.statistic == statistic, (name, finding)
    finding = check_day(broken("flip2", flip), stats[:4], bounds)
    rate = sum(s["label_rate"] * s["rows"] for s in stats[:4]) / sum(s["rows"] for s in stats[:4])
    assert finding.bound == (f"{rate / 1.5:.4f}..{rate * 1.5:.4f} ({rate:.4f}, the mean of the 4 days before, times"
                             " or divided by daily.validation.label_rate_ratio=1.5)")
    assert check_day(stats[0], [], bounds) is None
    assert check_day({**stats[0], "label_rate": 0.0}, [], bounds).statistic == "label_rate"


def test_job_stops_on_a_day_that_fails_validation(published, tmp_path):
    data, models = copy_of(published, tmp_path)
    make_days(data, 1, 1000, start=_date("2026-11-03"), first_index=2)
    rewrite_training_labels(data / "day_2026-11-03.tsv", "flip")
    error = the_error(run_daily(data, models))
    assert re.fullmatch(r"day_2026-11-03.tsv: label_rate 0\.\d{4} is beyond its bound \d\.\d{4}\.\.\d\.\d{4}"
                        r" \(\d\.\d{4}, the mean of the 2 days before, times or divided by"
                        r" daily.validation.label_rate_ratio=1.5\); the day's data changed: fix the export and rerun,"
                        r" or set the day aside with --skip-day 2026-11-03 --reason '...' \(it is then never trained;"
                        r" later days go on\); if the change is real, loosen daily.validation or rerun with"
                        r" --skip-validation \(which trains it\)", error), error
    record = records(models)["2026-11-03"]
    assert record["status"] == "invalid" and record["reason"] == error
    assert record["finding"]["statistic"] == "label_rate" and record["baseline_days"] == ["2026-11-01", "2026-11-02"]
    assert os.readlink(models / "current") == "versions/000001"
    run = run_daily(data, models, "--skip-validation")  # the operator knows the change is real
    assert run.returncode in (0, 3) and "2026-11-03: trained on 900 rows" in run.stdout
    assert records(models)["2026-11-03"]["validation"] == {"2026-11-03": "skipped (--skip-validation)"}



def trained_days(run: subprocess.CompletedProcess) -> list[str]:
    """The days a run trained, from its log lines."""
    return re.findall(r"^\[deepfm-daily\] (\d{4}-\d{2}-\d{2}): trained on \d+ rows$", run.stdout, re.M)


def test_an_invalid_day_waits_until_set_aside_and_then_is_never_trained(published, tmp_path, monkeypatch):
    """Day 03 (labels flipped) stops the run and the clean day 04 waits for it (the safe default); set aside with
    --skip-day, 03 is recorded as quarantined and 04 is trained against a baseline without it; no later run trains
    03 (catch-up, --force, --skip-validation, --train-late-days) until --release-day, after which it is a late day."""
    import datetime as dt
    import getpass
    import socket

    from disttrain.recsys.daily import OPERATOR_ENV

    monkeypatch.delenv(OPERATOR_ENV, raising=False)
    data, models = copy_of(published, tmp_path)
    make_days(data, 1, 1000, start=_date("2026-11-03"), first_index=2)
    rewrite_training_labels(data / "day_2026-11-03.tsv", "flip")
    invalid = the_error(run_daily(data, models))
    make_days(data, 1, 1000, start=_date("2026-11-04"), first_index=3)
    waits = run_daily(data, models)
    assert the_error(waits) == invalid and "--skip-day 2026-11-03 --reason '...'" in invalid
    assert trained_days(waits) == [] and "2026-11-04" not in records(models)
    finding = records(models)["2026-11-03"]["finding"]

    # (--auc-tolerance: the gate on 100 held-out rows is noisy; here it is about which days are trained)
    run = run_daily(data, models, "--skip-day", "2026-11-03", "--reason", "labels flipped upstream",
                    "--auc-tolerance", "0.1")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert trained_days(run) == ["2026-11-04"]
    by = f"{getpass.getuser()}@{socket.gethostname()}"
    assert f"set 2026-11-03 aside: quarantined by {by} (labels flipped upstream)" in run.stdout
    runs = records(models)
    aside = runs["2026-11-03"]
    assert (aside["status"], aside["reason"], aside["by"], aside["version"]) == (
        "quarantined", "labels flipped upstream", by, None)
    assert aside["previous_status"] == "invalid" and aside["finding"] == finding
    at = dt.datetime.fromisoformat(aside["at"])
    assert at.utcoffset() == dt.timedelta(0) and abs(dt.datetime.now(dt.timezone.utc) - at) < dt.timedelta(minutes=5)
    # 04 went in, validated against the days in the model only: the quarantined day is no part of its baseline
    assert runs["2026-11-04"]["status"] == "published" and runs["2026-11-04"]["quarantined_days"] == ["2026-11-03"]
    assert runs["2026-11-04"]["validation"]["2026-11-04"]["baseline_days"] == ["2026-11-01", "2026-11-02"]
    info = json.loads((models / "current" / "info.json").read_text())
    assert info["days"] == ["2026-11-01", "2026-11-02", "2026-11-04"]
    report = (models / "report.md").read_text()
    assert f"| 2026-11-03 | quarantined | - | 2026-11-04 | - | - | - | - | labels flipped upstream (set aside by {by}" \
           f" at {aside['at']}) |" in report
    assert "1 quarantined" in report

    # a day whose file never came can be set aside too: the days after it are then not held up as by a missing day
    monkeypatch.setenv(OPERATOR_ENV, "oncall: ana")
    ahead = run_daily(data, models, "--skip-day", "2026-11-05", "--reason", "export lost upstream")
    assert ahead.returncode == 0 and "it has no data file" in ahead.stdout and trained_days(ahead) == []
    assert records(models)["2026-11-05"]["by"] == "oncall: ana"
    make_days(data, 1, 1000, start=_date("2026-11-06"), first_index=5)
    assert the_error(run_daily(data, models, "--force", "--run-date", "2026-11-03")) == (
        f"--force would train 2026-11-03, but it is quarantined (set aside by {by} at {aside['at']}: labels flipped"
        " upstream) and a quarantined day is never trained; --release-day 2026-11-03 releases it (then --force"
        " --run-date 2026-11-03 trains it)")
    # the flags that train more days leave the quarantined ones out (--train-late-days would train 03 otherwise)
    more = run_daily(data, models, "--skip-validation", "--train-late-days", "--auc-tolerance", "0.1")
    assert more.returncode == 0 and trained_days(more) == ["2026-11-06"], more.stdout[-2000:]
    runs = records(models)
    assert runs["2026-11-03"] == aside and runs["2026-11-05"]["status"] == "quarantined"
    assert runs["2026-11-06"]["quarantined_days"] == ["2026-11-05"]

    # released, 03 counts as unprocessed again: older than the model's newest day, so late
    released = run_daily(data, models, "--release-day", "2026-11-03", "--reason", "export fixed")
    assert released.returncode == 0 and trained_days(released) == []
    assert "not training 2026-11-03: older than 2026-11-06, the newest day in the current model" in released.stdout
    late = records(models)["2026-11-03"]
    assert late["status"] == "late" and late["released"]["by"] == "oncall: ana"
    assert late["released"]["reason"].startswith("released by oncall: ana at ")
    assert late["released"]["quarantine"]["reason"] == "labels flipped upstream"
    # asked to train late days, the job now validates 03 again (its labels are still flipped)
    assert the_error(run_daily(data, models, "--train-late-days")).startswith("day_2026-11-03.tsv: label_rate ")



def test_on_invalid_day_quarantine_sets_the_day_aside_and_trains_the_later_days(published, tmp_path):
    """daily.on_invalid_day: quarantine: the job records the flipped day 03 as quarantined itself, warns in one
    line, trains 04 against a baseline without 03 and publishes (exit 0); a run whose only day is invalid trains
    nothing and exits 0; a value other than stop or quarantine is one error."""
    data, models = copy_of(published, tmp_path)
    make_days(data, 2, 1000, start=_date("2026-11-03"), first_index=2)
    rewrite_training_labels(data / "day_2026-11-03.tsv", "flip")
    config = write_config(tmp_path / "quarantine.yaml", daily={"on_invalid_day": "quarantine", "auc_tolerance": 0.1})
    run = run_daily(data, models, "--config", str(config))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert trained_days(run) == ["2026-11-04"] and run.stderr == ""
    warnings = [line for line in run.stdout.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and warnings[0].startswith("[deepfm-daily] WARNING: day_2026-11-03.tsv: label_rate ")
    assert warnings[0].endswith("; 2026-11-03 is set aside (quarantined: never trained) and later days go on"
                                " (daily.on_invalid_day: quarantine; --release-day 2026-11-03 releases it)")
    runs = records(models)
    aside = runs["2026-11-03"]
    assert aside["status"] == "quarantined" and aside["by"] == "daily job (daily.on_invalid_day: quarantine)"
    assert aside["reason"] == warnings[0][len("[deepfm-daily] WARNING: "):].split("; 2026-11-03 is set aside")[0]
    assert aside["finding"]["statistic"] == "label_rate" and aside["baseline_days"] == ["2026-11-01", "2026-11-02"]
    assert runs["2026-11-04"]["status"] == "published" and runs["2026-11-04"]["quarantined_days"] == ["2026-11-03"]
    assert runs["2026-11-04"]["validation"]["2026-11-04"]["baseline_days"] == ["2026-11-01", "2026-11-02"]
    assert json.loads((models / "current" / "info.json").read_text())["days"] == [
        "2026-11-01", "2026-11-02", "2026-11-04"]

    # the only new day is invalid: nothing is trained, the current model stays, exit 0
    make_days(data, 1, 1000, start=_date("2026-11-05"), first_index=4)
    rewrite_training_labels(data / "day_2026-11-05.tsv", "flip")
    alone = run_daily(data, models, "--config", str(config))
    assert alone.returncode == 0 and trained_days(alone) == [], alone.stdout[-2000:] + alone.stderr[-2000:]
    assert "nothing left to train up to 2026-11-05: 2026-11-05 set aside" in alone.stdout
    aside = records(models)["2026-11-05"]
    assert aside["status"] == "quarantined" and aside["baseline_days"] == ["2026-11-01", "2026-11-02", "2026-11-04"]
    assert os.readlink(models / "current") == "versions/000002"

    wrong = write_config(tmp_path / "wrong.yaml", daily={"on_invalid_day": "skip"})
    assert the_error(run_daily(data, models, "--config", str(wrong))) == (
        f"daily.on_invalid_day: 'skip' in {wrong} is not one of stop (the run stops there and later days wait for the"
        " operator); quarantine (the job sets the day aside itself and trains the later days)")


def test_setting_days_aside_fails_in_one_line(published, tmp_path, capsys):
    """--skip-day without --reason, of a trained day (published or rejected), --release-day of a day that is not
    quarantined, a bad date: one line each, and no record is written."""
    data, models = copy_of(published, tmp_path)
    make_days(data, 1, 1000, start=_date("2026-11-03"), first_index=2)
    before = records(models)
    assert the_error(run_daily(data, models, "--skip-day", "2026-11-03")) == (
        "--skip-day 2026-11-03 needs --reason TEXT: say why the day is set aside (recorded with who and when), e.g."
        " --reason 'labels flipped upstream'")
    assert the_error(run_daily(data, models, "--reason", "bad labels")) == (
        "--reason 'bad labels' says why a day is set aside or released; pass the day too (--skip-day DATE or"
        " --release-day DATE)")
    assert the_error(run_daily(data, models, "--skip-day", "2026-11-03", "--skip-day", "2026-11-02", "--reason",
                               "x")) == (
        "--skip-day 2026-11-02: the day is trained into version 000001 already; setting it aside would not take it"
        f" out: point current at a version from before it (ln -sfn versions/NNNNNN {models / 'current'}) to stop"
        " serving it")
    assert the_error(run_daily(data, models, "--release-day", "2026-11-03")) == (
        f"--release-day 2026-11-03: the day is not quarantined ({models / 'runs' / '2026-11-03.json'}: no record);"
        " only a day set aside is released")
    assert records(models) == before
    ModelStore(models).write_record("2026-11-03", {"day": "2026-11-03", "status": "rejected", "version": None,
                                                   "run_date": "2026-11-03", "previous_version": "000001"})
    assert the_error(run_daily(data, models, "--skip-day", "2026-11-03", "--reason", "x")) == (
        "--skip-day 2026-11-03: the day was trained already, in the run of 2026-11-03 that was rejected (version"
        " 000001 stayed current); it is not trained again unless --force, so there is nothing to set aside")

    from disttrain.recsys.daily import parser

    with pytest.raises(SystemExit):
        parser().parse_args(["--data-root", str(data), "--model-root", str(models), "--skip-day", "2026-11-31"])
    assert "argument --skip-day: date '2026-11-31' is not YYYY-MM-DD, e.g. 2026-11-29" in capsys.readouterr().err


def test_leftover_versions_are_removed_but_rolled_back_ones_kept(tmp_path):
    store = ModelStore(tmp_path)
    for name in ("000001", "000002", "000003", "000004"):
        (store.versions / name).mkdir(parents=True)
    store.write_record("2026-11-01", {"status": "published", "version": "000001"})
    store.write_record("2026-11-02", {"status": "published", "version": "000002"})
    store.point_at(store.versions / "000001")  # an operator rolled back from 000002
    assert store.remove_leftovers() == ["000003", "000004"]  # never pointed at: no record names them
    assert sorted(p.name for p in store.versions.iterdir()) == ["000001", "000002"]
    assert store.next_version(after=["000004"]).name == "000005"
