"""What an operator meets and what it leaves behind: a disk that fills (before and during each write of the daily
job and of a recipe's checkpoint) and a rank that stops (SIGSTOP) in a 2-process daily run and a 2-process recipe
run: one line, nothing half-written where a reader would take it, ``current`` unchanged, the next run goes on."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import DIST, ROOT, run_launched, run_torchrun
from test_recsys import RECIPE, published, records, run_daily, the_error  # noqa: F401 (a fixture)
from disttrain.parallel.checkpoint import io as ckpt
from disttrain.parallel.checkpoint.integrity import verify_checkpoint
from disttrain.parallel.guards.diskspace import FAIL_ENV, DiskFullError, disk_full_cause, ensure_free, writing
from disttrain.recsys.synthetic import make_days

DAY = "2026-11-{:02d}".format


# -- a full disk -------------------------------------------------------------------------------------------------
def test_a_full_disk_is_recognised_however_a_library_reports_it(tmp_path):
    """The messages measured on a full tmpfs: Python's ENOSPC, numpy's short write, torch.save's stream writer,
    safetensors' I/O error; DCP wraps any of them in a CheckpointException (a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    full = [OSError(errno.ENOSPC, "No space left on device", "x"), OSError(errno.EDQUOT, "Disk quota exceeded"),
            OSError("1000000 requested and 131056 written"),
            OSError("Not enough free space to write 67108864 bytes after offset 128"),
            RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
            Exception("Error while serializing: I/O error: No space left on device (os error 28)")]
    for error in full:
        assert disk_full_cause(error) is error
        wrapped = CheckpointException("save failed", {1: (error, None)})
        assert disk_full_cause(wrapped) is error
    chained = RuntimeError("logger failed")
    chained.__cause__ = full[0]
    assert disk_full_cause(chained) is full[0]
    for other in (OSError(errno.ENOENT, "No such file"), ValueError("bad value"), RuntimeError("shape mismatch")):
        assert disk_full_cause(other) is None

    with pytest.raises(DiskFullError, match=r"not enough disk space for the test write at .*: it needs 1024\.0 TiB,"
                                            r" .* has .* free; free space there"):
        ensure_free(tmp_path / "x", 1 << 50, "the test write", "free space there")

    tmp = tmp_path / ".partial"
    with pytest.raises(DiskFullError, match=r"disk full while writing the thing \(.*out\.bin; .* free there\);"
                                            r" the old one is kept; free space on that disk and rerun"):
        with writing(tmp_path / "out.bin", "the thing", kept="the old one is kept", cleanup=tmp):
            tmp.write_bytes(b"half")
            raise full[2]
    assert not tmp.exists()  # the failed write's space is given back
    with pytest.raises(ValueError):  # anything else passes through untouched
        with writing(tmp_path / "out.bin", "the thing"):
            raise ValueError("not a disk problem")


def test_checkpoint_save_on_a_full_disk_keeps_the_previous_one(tmp_path, monkeypatch, capsys):
    """A sharded save that fails at its shards, its meta.pt or its manifest: one DiskFullError, the previous
    checkpoint still there and verifying, no temporary folder left; a single-file save and an export likewise."""
    path = tmp_path / "ckpt"
    ckpt.save_sharded(path, {"model": {"w": torch.arange(6.0)}}, {"step": 1})
    for point in ("shard", "metadata", "manifest"):
        monkeypatch.setenv(FAIL_ENV, point)
        with pytest.raises(DiskFullError, match=r"^disk full while writing the checkpoint's .*; the previous"
                                                r" checkpoint is kept until a new one is complete"):
            ckpt.save_sharded(path, {"model": {"w": torch.zeros(6)}}, {"step": 2})
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
        verify_checkpoint(path)
        assert ckpt.read_meta(path)["step"] == 1
    monkeypatch.setenv(FAIL_ENV, "checkpoint")
    with pytest.raises(DiskFullError, match="disk full while writing the checkpoint"):
        ckpt.save_full(tmp_path / "one.pt", {"w": torch.ones(2)})
    monkeypatch.setenv(FAIL_ENV, "export")
    with pytest.raises(DiskFullError, match="disk full while writing the exported weights"):
        ckpt.write_safetensors({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]

    from disttrain.cli import main as cli

    export = ["export", str(path), str(tmp_path / "model.safetensors"), "--key", "model"]
    assert cli(export) == 1  # `disttrain export`: one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("disttrain export: error: disk full while writing the exported"
                                               " weights"), err
    monkeypatch.delenv(FAIL_ENV)
    assert cli(export) == 0 and (tmp_path / "model.safetensors").is_file()


# Each write of a daily run, in its order; the pointer swap publishes, so from "record" on the new version is current.
BEFORE_SWAP = ("cache", "shard", "metadata", "manifest", "info", "pointer")
AFTER_SWAP = ("record", "report")


def test_daily_job_on_a_full_disk_at_each_write(published, monkeypatch):
    """ENOSPC at each write of a run (the day's cache, a DCP shard, meta.pt, the manifest, info.json, the pointer,
    a day's record, the report): one line naming the write and what stays current; no temporary file or folder is
    left; before the swap ``current`` is unchanged and verifies; the next run (with space) publishes or completes
    what is missing."""
    data, models = published / "data", published / "models"  # this module's own copy of the fixture
    gate = ("--auc-tolerance", "1")  # tiny held-out sets: the tests are about the writes, not the AUC gate
    for i, point in enumerate(BEFORE_SWAP + AFTER_SWAP):
        day = DAY(3 + i)
        make_days(data, 1, 1000, start=_date(day), first_index=2 + i)
        before = os.readlink(models / "current")
        monkeypatch.setenv(FAIL_ENV, point)
        error = the_error(run_daily(data, models, *gate))
        monkeypatch.delenv(FAIL_ENV)
        assert "disk full while writing" in error and "free there" in error, (point, error)
        leftovers = [p for p in models.rglob(".*") if p.name not in (".lock", ".metadata")]
        assert not leftovers, (point, leftovers)
        if point in BEFORE_SWAP:
            assert error.endswith(f"nothing was published ({before.split('/')[-1]} stays current)"), error
            assert os.readlink(models / "current") == before
            verify_checkpoint(models / "current")
            assert day not in records(models) or records(models)[day]["status"] != "published"
        else:
            assert os.readlink(models / "current") != before
            assert ("the next run writes what is missing" if point == "record" else
                    "the next run draws it again") in error, error
        rerun = run_daily(data, models, *gate)
        assert rerun.returncode == 0, (point, rerun.stdout[-2000:], rerun.stderr[-2000:])
        assert records(models)[day]["status"] == "published", point
        assert "model history:" in rerun.stdout or point not in AFTER_SWAP, rerun.stdout


def _date(text: str):
    import datetime as dt

    return dt.date.fromisoformat(text)


def _tmpfs(path: Path, size: str) -> bool:
    """Mount a tmpfs of ``size`` at ``path`` (a real filesystem that fills up); False where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_daily_job_refuses_a_run_that_cannot_fit_on_a_real_full_disk(tmp_path):
    """The model root on a real 24 MiB filesystem, filled by other files: the run stops before writing with one
    line naming what it needs and what is free; nothing moves; with the space back the next run publishes. Also a
    real ENOSPC met mid-write (numpy's short write) is recognised."""
    mount = tmp_path / "fs"
    if not _tmpfs(mount, "24m"):
        pytest.skip("mounting a tmpfs needs root (the injected ENOSPC tests cover each write without it)")
    try:
        with pytest.raises(OSError) as short:
            with open(mount / "big.npy", "wb") as f:
                np.save(f, np.zeros(8 << 20))  # 64 MiB on a 24 MiB disk
        assert disk_full_cause(short.value) is not None
        (mount / "big.npy").unlink()

        data, models = tmp_path / "data", mount / "models"
        make_days(data, 2, 1000)
        assert run_daily(data, models).returncode == 0
        make_days(data, 1, 1000, start=_date("2026-11-03"), first_index=2)
        free = shutil.disk_usage(mount).free
        ballast = mount / "ballast"
        ballast.write_bytes(b"\0" * (free - (2 << 20)))  # 2 MiB left: less than a cache and two models
        error = the_error(run_daily(data, models))
        assert re.fullmatch(rf"not enough disk space for the caches of 1 day\(s\) and work/staging and a new version"
                            rf" as large as the current one at {models}: it needs \d+\.\d MiB, {models} has"
                            r" \d\.\d MiB free; free space there or move --model-root to a larger disk; nothing was"
                            r" published \(000001 stays current\)", error), error
        assert os.readlink(models / "current") == "versions/000001"
        assert not (models / "cache" / "day_2026-11-03").exists()
        ballast.unlink()
        run = run_daily(data, models, "--auc-tolerance", "1")
        assert run.returncode == 0 and "published version 000002" in run.stdout, run.stderr[-2000:]
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


# -- a stalled rank ----------------------------------------------------------------------------------------------
def test_watchdog_reports_a_silent_peer_and_not_one_that_finished():
    """Three ranks' watchdogs on one in-process store: rank 2 finishes (marks itself done) and rank 1 falls silent
    (its thread stops, as in a stopped process); rank 0 reports rank 1 alone, within the timeout."""
    import threading

    import torch.distributed as dist

    from disttrain.parallel.guards.watchdog import Watchdog, collective_timeout, set_phase

    store, lines, fired = dist.HashStore(), [], threading.Event()
    report = lambda line: (lines.append(line), fired.set())  # noqa: E731
    dogs = [Watchdog(store, rank, 3, timeout=2.0, label="test", advice="rerun", on_stall=report) for rank in range(3)]
    set_phase("training day 2026-11-04")
    for dog in dogs:
        dog.start()
    time.sleep(0.5)
    dogs[2].stop()  # finished: its silence is not a stall
    dogs[1]._stop.set()  # stopped: no more heartbeats, and no "done"
    silent_since = time.monotonic()
    assert fired.wait(10)
    took = time.monotonic() - silent_since
    dogs[0].stop()
    assert len(lines) == 1 and took <= 2.0 + 0.3, (lines, took)
    assert re.fullmatch(r"test: rank 0: rank 1 \(pid \d+ on \S+\) has not answered for \d s \(timeout 2 s\) while"
                        r" training day 2026-11-04: a process stopped, hung or was killed; ending the run; rerun",
                        lines[0]), lines
    assert collective_timeout(600).total_seconds() == 615 and collective_timeout(20).total_seconds() == 25


def test_a_collective_that_never_completes_is_one_line():
    """gloo's errors when every rank is alive but one never joins (measured: rank 1 asleep past the process group's
    timeout): the waiting rank's timeout and its peer's closed connection, each one line; other errors are not."""
    from disttrain.parallel.guards.watchdog import describe_collective_timeout, set_phase

    set_phase("evaluating")
    waited = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out"
                          " waiting 9000ms for recv operation to complete")
    closed = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed"
                          " by peer [127.0.0.1]:58568. This is typically caused by a remote worker crashing. Check the"
                          " logs of the remote worker before reporting an error. GLHF!")
    assert describe_collective_timeout(waited, 4) == (
        "a collective did not complete within 9 s while evaluating (Timed out waiting 9000ms for recv operation to"
        " complete): a peer stopped, crashed or is stuck on its device")
    assert describe_collective_timeout(closed, 4).startswith(
        "a collective did not complete within 9 s while evaluating (Connection closed by peer [127.0.0.1]:58568):")
    assert describe_collective_timeout(RuntimeError("shape mismatch"), 4) is None
    assert describe_collective_timeout(ValueError("Timed out"), 4) is None


def test_every_strategy_takes_a_timeout(monkeypatch):
    """timeout= in seconds or as a timedelta on every adapter (the watchdog's; collectives a little longer), the
    environment's DISTTRAIN_TIMEOUT for a strategy given by name, one clear error for a bad value."""
    import datetime as dt

    import disttrain

    classes = [getattr(module, name) for module in (disttrain.strategies, disttrain.fabric)
               for name in ("DDPStrategy", "FSDPStrategy", "ZeroStrategy", "MegatronStrategy", "RecsysStrategy",
                            "AutoStrategy")]
    for cls in classes:
        strategy = cls(timeout=dt.timedelta(minutes=2))
        assert strategy._watchdog_timeout == 120 and strategy._timeout.total_seconds() == 135, cls  # 3 heartbeats of 5 s
        assert cls()._watchdog_timeout == 600
    monkeypatch.setenv("DISTTRAIN_TIMEOUT", "45")
    assert disttrain.strategies.FSDPStrategy()._watchdog_timeout == 45
    assert disttrain.fabric.FSDPStrategy(timeout=30)._watchdog_timeout == 30  # an explicit value wins
    with pytest.raises(ValueError, match=r"timeout='soon' is not a number of seconds; pass e.g. timeout=600"):
        disttrain.strategies.FSDPStrategy(timeout="soon")
    monkeypatch.setenv("DISTTRAIN_TIMEOUT", "-1")
    with pytest.raises(ValueError, match=r"DISTTRAIN_TIMEOUT='-1': timeout='-1' must be a positive number"):
        disttrain.fabric.DDPStrategy()


STALL_TIMEOUT = 15  # seconds; the defaults are 300 (daily job) and 600 (strategies)


def stalled_at(stdout: str) -> float:
    return float(re.search(r"stall injected at \S+ on rank 1 at (\d+\.\d+)", stdout).group(1))


@pytest.mark.slow
def test_daily_job_ends_on_every_live_rank_when_a_rank_stops(tmp_path):
    """torchrun with 2 processes; rank 1 stops (SIGSTOP) after training the first of two days. Rank 0 ends the run
    within the timeout with one line naming rank 1 and the day it was training; nothing is published; the next
    run resumes from the finished day and publishes."""
    data, models = tmp_path / "data", tmp_path / "models"
    make_days(data, 2, 3000)
    run = run_torchrun(str(RECIPE.relative_to(ROOT)), "--data-root", str(data), "--model-root", str(models),
                       "--accelerator", "cpu", "--timeout", str(STALL_TIMEOUT),
                       run_env={"DISTTRAIN_STALL_AT": "after-day-2026-11-01@1"}, timeout=300)
    ended = time.time()
    assert run.returncode == 4, run.stdout[-3000:] + run.stderr[-3000:]
    took = ended - stalled_at(run.stdout)
    print(f"daily job: the run ended {took:.1f} s after rank 1 stopped (timeout {STALL_TIMEOUT} s)")
    assert took < STALL_TIMEOUT + 5  # the watchdog fires within the timeout; the launcher then collects the ranks
    lines = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and re.fullmatch(
        rf"deepfm_daily\.py: error: rank 0: rank 1 \(pid \d+ on \S+\) has not answered for \d+ s \(timeout"
        rf" {STALL_TIMEOUT} s\) while .*: a process stopped, hung or was killed; ending the run; nothing was"
        r" published; the next run resumes from the last finished day \(work/staging\)", lines[0]), run.stderr[-3000:]
    assert not (models / "current").exists() and not list((models / "runs").glob("*.json"))
    resumed = run_daily(data, models)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "(resuming; trained: ['2026-11-01'])" in resumed.stdout and "published version 000001" in resumed.stdout


@pytest.mark.slow
def test_recipe_ends_on_every_live_rank_when_a_rank_stops(tmp_path):
    """The dialogue recipe on 2 processes (disttrain_fsdp, --timeout 15 through DISTTRAIN_TIMEOUT as `lightning run
    model --timeout` sets it); rank 1 stops at step 3 after the checkpoint of step 2. Rank 0 ends within the
    timeout with one line naming rank 1 and the step; nothing is exported. A resume whose checkpoint meets a full
    disk is one line and leaves step 2's checkpoint intact; a resume with space finishes."""
    from disttrain.nlp.corpus import demo_data

    demo_root = tmp_path / "demo"
    demo_data(demo_root)
    out = tmp_path / "out"
    args = ("recipes/nlp/dialogue_llm.py", "--demo-root", str(demo_root), "--out", str(out), "--config",
            "configs/nlp/dialogue_demo.yaml", "--steps", "4", "--eval-every", "100", "--save-every", "2",
            "--no-report")
    run = run_launched(*args, strategy="disttrain_fsdp", timeout=300,
                       run_env={"DISTTRAIN_TIMEOUT": str(STALL_TIMEOUT), "DISTTRAIN_STALL_AT": "step-3@1"})
    ended = time.time()
    assert run.returncode == 4, run.stdout[-3000:] + run.stderr[-3000:]
    took = ended - stalled_at(run.stdout)
    print(f"dialogue recipe: the run ended {took:.1f} s after rank 1 stopped (timeout {STALL_TIMEOUT} s)")
    assert took < STALL_TIMEOUT + 5  # the watchdog fires within the timeout; the launcher then collects the ranks
    assert re.search(rf"disttrain_fsdp: rank 0: rank 1 \(pid \d+ on \S+\) has not answered for \d+ s \(timeout"
                     rf" {STALL_TIMEOUT} s\) while training, training step 3: a process stopped, hung or was killed;"
                     r" ending the run; the checkpoints written so far are intact: resume from the last one",
                     run.stderr), run.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]
    assert not (out / "hf").exists()

    # Then the disk is full when step 4's checkpoint is written: one line from rank 0, step 2's checkpoint intact.
    full = run_launched(*args, "--resume", str(out / "checkpoints" / "step-000002"), strategy="disttrain_fsdp",
                        timeout=600, run_env={FAIL_ENV: "shard"})
    # Every rank exits 1; a launcher then ends a rank still in its exit handlers (-15), and which one it reports
    # first is a race (torchrun reports 1 for either): failed, and not as a stall (4).
    assert full.returncode not in (0, 4), full.stdout[-3000:] + full.stderr[-3000:]
    errors = [line for line in full.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(
        f"dialogue_llm: error: disk full while writing the checkpoint's shards ({out / 'checkpoints' / 'step-000004'};"
    ), full.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]
    verify_checkpoint(out / "checkpoints" / "step-000002")

    resumed = run_launched(*args, "--resume", str(out / "checkpoints" / "step-000002"), strategy="disttrain_fsdp",
                           timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed at step 2" in resumed.stdout and (out / "hf").is_dir()


def twin_host(*command: str) -> list[str]:
    """``command`` in a new pid, UTS and mount namespace with /proc of its own and the host name "twin": another host
    cloned from the same image, as far as host names and pid numbers go."""
    return ["unshare", "--pid", "--uts", "--mount", "--fork", "--mount-proc", "sh", "-c",
            'hostname twin && exec "$@"', "twin", *command]


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs root and unshare (util-linux) for pid and UTS namespaces")
def test_watchdog_never_signals_a_twin_on_another_host():
    """Two "hosts" with the same host name and their own pid numbering: a rank of the other host announces itself and
    stops; on this host a decoy process has that very pid. The watchdog reports the rank and signals nothing (the
    rule of matching host name and pid would have killed the decoy), while the decoy's own identity is accepted."""
    from disttrain.parallel.guards.watchdog import is_this_process

    python = sys.executable
    # The other host: sh is pid 1, `hostname` 2 and the rank 3.
    other = subprocess.run(twin_host("sh", "-c", f"{python} -c 'import json; from disttrain.parallel.guards.watchdog"
                                     " import process_identity; print(json.dumps(process_identity()))'; true"),
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr[-2000:]
    announced = json.loads(other.stdout.strip().splitlines()[-1])
    assert announced["host"] == "twin" and not is_this_process(announced)  # not this test's namespace either
    # This host: numbered as the other was, so the decoy (started third) gets the announced pid.
    local = subprocess.run(twin_host("sh", "-c", f'sleep 60 & exec {python} {DIST / "watchdog_twin.py"} "$0" $!',
                                     json.dumps(announced)), capture_output=True, text=True, timeout=120)
    assert local.returncode == 0, local.stderr[-2000:]
    result = json.loads(local.stdout.strip().splitlines()[-1])
    assert result["same_host_and_pid"], (announced, result)  # the hazard is real: same name, same pid
    assert not result["accepted"] and result["decoy_accepted"]
    assert result["decoy_state"] in ("S", "R"), result  # alive, never signalled
    assert len(result["lines"]) == 1
    assert f"rank 1 (pid {announced['pid']} on twin) has not answered" in result["lines"][0]
