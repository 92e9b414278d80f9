"""Runs a person can watch: progress output (off when stdout is not a terminal), the TensorBoard and CSV loggers
under the run folder, the run report drawn back from the logs, and the daily job's model-history report."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from conftest import ROOT, child_env
from disttrain.report import (PANELS, ReportError, StepProgress, fabric_loggers, interactive, parse_logger_spec,
                              read_metrics, read_run_info, start_run, write_report, write_run_info)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def table(md: str, header: str) -> dict[str, list[str]]:
    """The rows of the Markdown table whose header starts with ``header``: first cell -> other cells."""
    lines = md.split(header, 1)[1].splitlines()[2:]
    rows = {}
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def number(cell: str) -> float:
    return float(cell.replace(",", ""))


# ---- logger choice and progress output ----

def test_logger_spec_choices_and_did_you_mean():
    assert parse_logger_spec(None) == ["tensorboard", "csv"]
    assert parse_logger_spec("csv") == ["csv"]
    assert parse_logger_spec("none") == [] and parse_logger_spec("") == []
    with pytest.raises(ValueError, match="unknown logger 'tensorbord'; did you mean 'tensorboard'"):
        parse_logger_spec("tensorbord,csv")


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_plain_lines_when_stdout_is_not_a_terminal(monkeypatch):
    for var in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "KUBERNETES_SERVICE_HOST", "AIRFLOW_CTX_DAG_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert interactive(FakeTTY()) and not interactive(io.StringIO())
    monkeypatch.setenv("SLURM_JOB_ID", "42")  # a batch job's log is a file even when a pty is attached
    assert not interactive(FakeTTY())

    out = io.StringIO()
    with redirect_stdout(out):
        with StepProgress(total=20, description="train") as bar:  # decides by sys.stdout: not a TTY here
            for i in range(20):
                bar.update(loss=1.0 / (i + 1))
            bar.print("step 20  held-out loss 0.5")
        with StepProgress(total=20, enabled=False) as other_rank:
            other_rank.update(loss=1.0)
            other_rank.print("not printed")
    text = out.getvalue()
    assert "\r" not in text and "\x1b[" not in text  # nothing redrawn, no terminal codes
    lines = text.splitlines()
    assert [line.split()[1] for line in lines[:-1]] == [f"{n}/20" for n in range(2, 21, 2)]  # ~10 lines a run
    assert lines[-1] == "step 20  held-out loss 0.5" and "not printed" not in text


# ---- the run report from logged metrics ----

def fabric_run(run_dir: Path, steps: int, finish: bool) -> None:
    """A short single-process Fabric run that logs what the recipes log, through the same helpers."""
    import lightning as L
    import torch

    from disttrain.callbacks import Throughput

    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=fabric_loggers(run_dir, "tensorboard,csv"))
    start_run(run_dir, recipe="test", strategy=fabric.strategy, world_size=1, device="cpu", precision="32-true")
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    tp = Throughput(every_n_steps=2, flops_per_batch=1e6, peak_flops=1e9)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for step in range(1, steps + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        tp.step(fabric, tokens=64 * 8, samples=64)
        fabric.log_dict({"train/loss": loss.item(), "train/lr": 0.1, "time/elapsed_s": 0.5 * step}, step=step)
        if step % 3 == 0:
            fabric.log_dict({"val/loss": loss.item() * 1.1, "val/acc": 0.5 + step / 100}, step=step)
    if finish:
        for logger in fabric.loggers:
            logger.finalize("success")
        write_run_info(run_dir, finished=True, wall_s=12.5)


def test_report_reads_back_the_logged_metrics(tmp_path):
    fabric_run(tmp_path, steps=6, finish=True)
    assert list((tmp_path / "logs/tensorboard/version_0").glob("events.out.tfevents.*"))
    metrics = read_metrics(tmp_path)
    png, md = write_report(tmp_path)
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 20_000
    text = md.read_text()
    assert "Panels: " + ", ".join(PANELS) + "." in text
    rows = table(text, "| metric |")
    assert set(rows) == {"train/loss", "val/loss", "val/acc", "train/lr", "throughput/tokens_per_s",
                         "throughput/mfu"}
    for key, cells in rows.items():  # first and last values are those in metrics.csv
        assert number(cells[0]) == pytest.approx(metrics[key][0][1], rel=1e-3), key
        assert number(cells[1]) == pytest.approx(metrics[key][-1][1], rel=1e-3), key
    assert number(rows["val/acc"][2]) == pytest.approx(0.56)  # accuracy: best is the largest
    memory = table(text, "| rank |")
    assert number(memory["0"][0]) == pytest.approx(metrics["memory/peak_mib_rank0"][-1][1], rel=1e-3)
    assert "wall time: 12.5 s (finished)" in text and "strategy: SingleDeviceStrategy" in text


def test_report_of_an_interrupted_run_and_of_a_resumed_one(tmp_path):
    fabric_run(tmp_path, steps=4, finish=False)  # stopped: no finalize, run.json not finished
    text = write_report(tmp_path)[1].read_text()
    assert "wall time: 2.0 s (interrupted" in text and "last logged step: 4" in text
    fabric_run(tmp_path, steps=6, finish=True)  # started again in the same folder: a second CSV version
    assert (tmp_path / "logs/csv/version_1/metrics.csv").is_file()
    assert [s for s, _ in read_metrics(tmp_path)["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert read_run_info(tmp_path)["finished"] is True


def test_report_of_a_folder_without_csv_logs_says_how_to_fix(tmp_path):
    from disttrain.cli import main

    with pytest.raises(ReportError, match="--logger csv"):
        write_report(tmp_path)
    assert main(["report", str(tmp_path)]) == 1


# ---- the daily job's model history ----

def test_daily_history_report_shows_published_and_rejected_versions(tmp_path):
    from test_recsys import run_daily

    from disttrain.recsys.synthetic import make_days

    data, models = tmp_path / "data", tmp_path / "models"
    make_days(data, 2, 3000)
    assert run_daily(data, models, "--run-date", "2026-11-01").returncode == 0
    assert run_daily(data, models, "--run-date", "2026-11-02", "--min-auc", "0.999").returncode == 3  # rejected
    assert (models / "logs/2026-11-01/csv/version_0/metrics.csv").is_file()
    assert list((models / "logs/2026-11-02/tensorboard/version_0").glob("events.out.tfevents.*"))
    text = (models / "report.md").read_text()
    assert (models / "report.png").read_bytes()[:8] == PNG_MAGIC
    rows = table(text, "| day |")
    assert [rows[d][0] for d in ("2026-11-01", "2026-11-02")] == ["published", "rejected"]
    for day, cells in rows.items():  # AUC, log loss and calibration as the job recorded them
        record = json.loads((models / "runs" / f"{day}.json").read_text())
        for cell, key in zip(cells[3:6], ("auc", "logloss", "calibration")):
            assert float(cell) == pytest.approx(record["metrics"][key], abs=1e-4)
    assert "auc per day" in text and "calibration per day" in text


# ---- a recipe end to end (one process) ----

@pytest.mark.slow
def test_dialogue_recipe_writes_logs_and_report_without_a_progress_bar(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "recipes/nlp/dialogue_llm.py", "--devices", "1", "--strategy", "auto", "--steps", "4",
           "--eval-every", "2", "--micro-batch", "4", "--out", str(out), "--demo-root", str(tmp_path / "demo")]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "\r" not in proc.stdout and "\x1b[" not in proc.stdout  # stdout is a pipe: plain lines only
    assert re.search(r"^train 4/4 \(100%\)  loss \d", proc.stdout, re.M)
    assert (out / "logs/csv/version_0/metrics.csv").is_file()
    assert list((out / "logs/tensorboard/version_0").glob("events.out.tfevents.*"))
    metrics = read_metrics(out)
    rows = table((out / "report.md").read_text(), "| metric |")
    assert number(rows["val/ppl"][1]) == pytest.approx(metrics["val/ppl"][-1][1], rel=1e-3)
    assert [s for s, _ in metrics["val/loss"]] == [0, 2, 4] and len(metrics["train/loss"]) == 4
    assert "throughput/tokens_per_s" in rows and "memory/peak_mib_rank0" in metrics
    assert read_run_info(out)["finished"] is True and (out / "report.png").stat().st_size > 20_000
    (out / "report.png").unlink()  # docs/runs.md: `disttrain report RUN_DIR` draws it again from the logs
    from disttrain.cli import main

    assert main(["report", str(out)]) == 0 and (out / "report.png").stat().st_size > 20_000
