"""Runs a person can watch: progress output (off when stdout is not a terminal), the TensorBoard and CSV loggers
under the run folder, the run report drawn back from the logs, and the daily job's model-history report."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from conftest import run_python
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


# ---- the job log: library output in a file, the operator's lines on the console ----

def test_job_log_keeps_library_output_in_its_file_once_and_the_operators_lines_on_stderr(tmp_path):
    import logging
    import warnings

    import lightning.pytorch  # noqa: F401  (its console handler: detached while the job log runs)

    from disttrain.parallel.checkpoint.integrity import warn_unverified
    from disttrain.report.joblog import job_log, log_path

    lightning_logger = logging.getLogger("lightning.pytorch")
    before = (list(lightning_logger.handlers), lightning_logger.propagate, warnings.showwarning)
    err = io.StringIO()
    with redirect_stderr(err), job_log(tmp_path, started=0.0) as log:
        warnings.simplefilter("always")  # what the job log dedupes, not the warnings registry
        for _ in range(3):
            warnings.warn("a library's notice", FutureWarning)  # issued here, outside disttrain: the file only
            logging.getLogger("lightning.pytorch.utilities.rank_zero").info("GPU available: False, used: False")
            logging.getLogger("somelib").error("a library failed")
        warn_unverified(tmp_path / "checkpoint")  # disttrain's own warning: the operator must know
        logging.getLogger("disttrain.test").warning("disttrain's own warning")
        logging.getLogger("disttrain.test").info("2026-11-01: train 1/4")
        log.error("prog: error: the day file is missing")
    lines = err.getvalue().splitlines()
    assert len(lines) == 4 and "UnverifiedCheckpointWarning: checkpoint" in lines[1], lines
    assert [lines[0], lines[2], lines[3]] == ["ERROR somelib: a library failed",
                                              "WARNING disttrain.test: disttrain's own warning",
                                              "prog: error: the day file is missing"]
    assert (list(lightning_logger.handlers), lightning_logger.propagate, warnings.showwarning) == before

    path = log_path(tmp_path, started=0.0)
    assert path == tmp_path / "job-1970-01-01.log"
    lines = path.read_text().splitlines()
    assert all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ rank0 ", line) for line in lines), lines
    kinds = [line.split()[2] for line in lines]
    assert kinds == ["run", "FutureWarning", "INFO", "ERROR", "UnverifiedCheckpointWarning", "WARNING", "INFO",
                     "error", "run"], lines
    notice = lines[1]
    assert notice.endswith(": a library's notice") and f"{Path(__file__).name}:" in notice  # where it came from
    assert " INFO lightning.pytorch.utilities.rank_zero " in lines[2]
    assert lines[2].endswith(": GPU available: False, used: False")
    assert lines[0].split(" ", 3)[2:4] == ["run", "started: pid " + lines[0].split("pid ")[1]]
    assert lines[-1].split(" ", 3)[3].startswith("ended: after ")


def test_job_log_of_other_ranks_verbose_and_unwritable(tmp_path):
    import logging

    from disttrain.report.joblog import job_log

    err = io.StringIO()
    with redirect_stderr(err), job_log(tmp_path, rank=1, started=0.0) as log:
        log.error("prog: error: on every rank")  # rank 0 says it; rank 1 keeps it in its own file
    assert err.getvalue() == ""
    assert "rank1 error job: prog: error: on every rank" in (tmp_path / "job-1970-01-01.rank1.log").read_text()

    with redirect_stderr(err), job_log(tmp_path / "verbose", verbose=True, started=0.0):
        logging.getLogger("somelib").warning("a library's warning")
    assert re.fullmatch(r"\S+ rank0 WARNING somelib \S+:\d+: a library's warning\n", err.getvalue())

    (tmp_path / "a-file").write_text("")
    err = io.StringIO()
    with redirect_stderr(err), job_log(tmp_path / "a-file" / "logs", started=0.0):
        logging.getLogger("somelib").warning("no file to go to")
    lines = err.getvalue().splitlines()
    assert lines[0].startswith(f"cannot write the job log {tmp_path}/a-file/logs/job-1970-01-01.log (")
    assert len(lines) == 2 and re.fullmatch(r"\S+ rank0 WARNING somelib \S+:\d+: no file to go to", lines[1])


def test_job_log_appends_whole_lines_from_concurrent_writers(tmp_path):
    """Two writers on one file (a run and a second one refused by its lock) each append whole records: one
    O_APPEND write per record, never a line of one inside a line of the other."""
    import logging
    import threading

    from disttrain.report.joblog import JobLog

    path = tmp_path / "job.log"
    logs = [JobLog(path, rank, stderr=io.StringIO()) for rank in (0, 1)]

    def write(log: JobLog) -> None:
        for i in range(200):
            log.handle(logging.makeLogRecord({"name": "lib", "levelno": logging.INFO, "levelname": "INFO",
                                              "msg": f"{log.rank}-{i} " + "x" * 8000, "pathname": "lib.py",
                                              "lineno": i}))
    threads = [threading.Thread(target=write, args=(log,)) for log in logs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for log in logs:
        log.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 400
    assert all(re.fullmatch(r"\S+ rank(\d) INFO lib lib.py:(\d+): \1-\2 x{8000}", line) for line in lines)


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
    proc = run_python("recipes/nlp/dialogue_llm.py", "--devices", "1", "--strategy", "auto", "--steps", "4",
                      "--eval-every", "2", "--micro-batch", "4", "--out", str(out), "--demo-root", str(tmp_path / "demo"),
                      timeout=600)
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
