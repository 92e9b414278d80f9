"""``bench/gpu_check.py`` cannot rot: its dry run (every check, tiny sizes, on CPU) runs here and its report is read
back row by row; a run whose budget is spent skips its checks and says why instead of overrunning."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from conftest import ROOT, run_python

SCRIPT = ROOT / "bench" / "gpu_check.py"
LABELS = ["1 MFU", "2 attention", "3 FP8", "4 fp16 + sharded scaler", "5 offload", "6 planner",
          "7 megatron / pipeline", "8 recipes", "9 step time"]


def gpu_check(out, *args: str, timeout: int = 1500) -> tuple[subprocess.CompletedProcess, dict]:
    proc = run_python(str(SCRIPT), "--dry-run", "--out", str(out), *args, timeout=timeout)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
    return proc, report


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    t0 = time.perf_counter()
    proc, report = gpu_check(out)
    return proc, report, out, time.perf_counter() - t0


def rows_of(report: dict, label: str) -> list[dict]:
    return [r for r in report["rows"] if r["check"] == label]


@pytest.mark.slow
def test_dry_run_runs_every_check_and_nothing_fails(dry_run):
    proc, report, out, seconds = dry_run
    assert report, f"no report.json; exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    failed = [r for r in report["rows"] if r["status"] == "fail"]
    assert not failed, json.dumps(failed, indent=1)[:4000] + "\n" + (out / "log.txt").read_text()[-4000:]
    assert proc.returncode == 0 and report["dry_run"]
    assert [label for label in LABELS if not rows_of(report, label)] == []
    for row in report["rows"]:
        assert row["status"] in ("pass", "dry", "skipped"), row
        if row["status"] == "skipped":
            assert row["reason"], row  # every skip says why
        else:
            assert row["figure"] not in ("", "-") and row["target"], row
    print(f"dry run: {seconds:.0f} s")


@pytest.mark.slow
def test_dry_run_judges_numerics_and_reports_device_figures(dry_run):
    _, report, _, _ = dry_run
    # Losses, skip counts and matches hold on any device: judged, and they pass.
    fp8 = rows_of(report, "3 FP8")
    assert len(fp8) == 2 and fp8[0]["status"] == "pass" and fp8[0]["value"] <= 0.01
    fp16 = rows_of(report, "4 fp16 + sharded scaler")[0]
    assert fp16["status"] == "pass" and fp16["value"] >= 1 and fp16["details"]["scaler"] == "ShardedGradScaler"
    megatron = rows_of(report, "7 megatron / pipeline")
    assert [r["status"] for r in megatron] == ["pass"] * 4, megatron
    recipes = {r["item"].split(",")[0]: r for r in rows_of(report, "8 recipes")}
    assert recipes["dialogue_llm.py"]["status"] == "pass" and recipes["vit2b.py"]["status"] == "pass"
    # Device figures (MFU, memory, speed) mean nothing on a CPU: reported, not judged.
    mfu = rows_of(report, "1 MFU")
    assert [r["status"] for r in mfu] == ["dry", "dry"] and all(r["value"] > 0 for r in mfu)
    assert mfu[0]["details"]["profile"]["top"], "the profile of a step below target lists what took the time"
    assert len(rows_of(report, "6 planner")) == 4
    steps = rows_of(report, "9 step time")  # the calibrated planner's prediction beside each tried plan's measurement
    assert len(steps) == 1 and steps[0]["status"] == "dry" and steps[0]["details"]["chosen"], steps
    assert all(r["details"]["predicted_s"] > 0 and r["details"]["measured_s"] > 0 for r in steps)
    assert {r["status"] for r in rows_of(report, "2 attention") if "tokens" in r["item"]} == {"dry"}


@pytest.mark.slow
def test_markdown_report_has_the_table_and_the_packages(dry_run):
    _, report, out, _ = dry_run
    md = (out / "report.md").read_text()
    assert "DRY RUN" in md and "| check | what | figure | target | status | reason | s |" in md
    assert all(f"| {label} |" in md for label in LABELS)
    assert "## Packages the machine lacks" in md and "flash-attn" in md and "fbgemm-gpu" in md
    assert report["env"]["torch"] and report["wall_s"] < report["budget_s"]


@pytest.mark.slow
def test_spent_budget_skips_with_a_reason_instead_of_overrunning(tmp_path):
    t0 = time.perf_counter()
    proc, report = gpu_check(tmp_path, "--budget", "1", "--only", "fp16", "recipes")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["check"] for r in report["rows"]] == ["4 fp16 + sharded scaler", "8 recipes"]
    for row in report["rows"]:
        assert row["status"] == "skipped" and "budget" in row["reason"], row
    assert time.perf_counter() - t0 < 60  # stopped at the deadline, not after the checks' own time
