"""Every GPU-relevant check of disttrain in one command, with a time budget, writing a Markdown + JSON report.

    PYTHONPATH=src python3 bench/gpu_check.py --out runs/gpu_check            # one GPU: at most 8 minutes
    PYTHONPATH=src python3 bench/gpu_check.py --out /tmp/dry --dry-run        # the same checks on CPU, tiny sizes
    make gpu-check                                                            # the first, with the wheels of make gpu-wheels
    python3 bench/gpu_check.py --list                                         # the checks, their budgets

Checks (``bench/gpu_checks/``): 1 MFU of the 1B config and of a full-width slice of the 10B config, 2 SDPA flash
vs eager attention, 3 FP8 (torchao) vs bf16, 4 fp16 with the sharded scaler, 5 CPU offload, 6 the planner's memory
estimate vs the allocator's peak, 7 ``disttrain_megatron`` and the pipeline code on CUDA tensors, 8 the recipes,
9 the planner's step time vs measured steps after calibrating the device.

How the budget holds: the checks run one after another in a worker process (imports paid once), which starts a
check only if its usual time is left; this process stops the worker when a check outlasts its own budget or the
run's deadline, records why, and starts a fresh worker for the checks after it. A check that crashes its worker
costs only itself. The report is ``OUT/report.md`` and ``OUT/report.json``; the workers' output is
``OUT/log.txt``. Scratch files (recipe runs, data) go to a temporary folder that is removed at the end.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_checks import BY_NAME, CHECKS, Check  # noqa: E402
from gpu_checks.rows import Row  # noqa: E402

GPU_BUDGET_S = 450.0  # 7.5 minutes: 8 minutes in all, less the report and a margin
DRY_BUDGET_S = 900.0  # CPU dry runs on a loaded 2-core machine: generous, so CI never skips a check for time
POLL_S = 0.25

# What a GPU machine's own Python may lack, whether `make gpu-wheels` brings it, and which rows go without it.
PACKAGES = (
    ("torchao", "torchao", "3 FP8", "brought by `make gpu-wheels` (3.4 MB wheel)"),
    ("deepspeed", "deepspeed", "5 offload: zero3 rows",
     "brought by `make gpu-wheels` (2.2 MB wheel built from the source release, plus hjson and pydantic); "
     "DeepSpeed's CPU Adam is not used there (a JIT build of minutes), torch's AdamW is"),
    ("chatterbot-corpus", "chatterbot_corpus", "8 recipes: dialogue demo corpus",
     "brought by `make gpu-wheels` (0.3 MB); without it the check writes a small corpus of its own"),
    ("flash-attn", "flash_attn", "2 attention: flash-attn row",
     "not brought: PyPI has the source only, and it needs a CUDA build of about an hour; install it yourself"),
    ("torchrec + fbgemm-gpu", "torchrec", "8 recipes: DeepFM row",
     "not brought: fbgemm-gpu 1.9.0 is a 498 MB CUDA wheel built for torch 2.14; install torchrec and "
     "fbgemm-gpu for the machine's torch yourself"),
)


# ------------------------------------------------------------------------------------------------ the worker

def worker(args: argparse.Namespace) -> int:
    """Run ``args.names`` in order, appending events to the progress file as JSON lines."""
    progress = open(args.progress, "a", buffering=1)

    def emit(event: dict) -> None:
        progress.write(json.dumps(event, default=str) + "\n")

    from gpu_checks.common import Context
    from gpu_checks.rows import Row

    if not args.skip_env:
        emit({"event": "env", "env": environment(args.dry_run)})
    ctx = Context(dry=args.dry_run, work=Path(args.work))
    for i, name in enumerate(args.names):
        check = BY_NAME[name]
        left = args.deadline - time.time()
        if left < check.expected_s * (0.2 if args.dry_run else 1.0):
            for rest in args.names[i:]:
                c = BY_NAME[rest]
                emit({"event": "row", "row": not_started(c, f"not started: {max(left, 0):.0f} s of the budget left, "
                                                           f"it usually takes {c.expected_s:.0f} s").to_json()})
            break
        emit({"event": "start", "check": name, "t": time.time()})
        t0 = time.perf_counter()
        try:
            import importlib

            # Rows are emitted as they come: a check stopped at its budget keeps the parts it finished.
            for row in importlib.import_module(check.module).run(ctx):
                row.seconds = round(time.perf_counter() - t0, 1)
                emit({"event": "row", "row": row.judged(args.dry_run).to_json()})
                t0 = time.perf_counter()
        except Exception as e:  # noqa: BLE001  (the report says what broke; the next check still runs)
            traceback.print_exc()
            row = Row(check.label, check.what, "-", "runs", False, f"{type(e).__name__}: {e}"[:600])
            emit({"event": "row", "row": row.judged(args.dry_run).to_json()})
        emit({"event": "end", "check": name, "t": time.time()})
        _release_memory()
    return 0


def _release_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def not_started(check: Check, reason: str) -> Row:
    row = Row(check.label, check.what, "-", "-", None, reason)
    row.status = "skipped"
    return row


def environment(dry: bool) -> dict[str, Any]:
    """Versions and the machine, as the worker (with torch imported) sees them."""
    import platform

    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cpus": os.cpu_count(), "dry_run": dry}
    for name in ("lightning", "transformers", "timm", "torchmetrics"):
        env[name] = _version(name)
    try:
        import psutil

        env["host_memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", gpus=torch.cuda.device_count())
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            pass
    packages = {}
    for label, module, needed_by, carried in PACKAGES:
        from gpu_checks.training import optional_import

        missing = optional_import(module)
        packages[label] = {"available": missing is None, "version": _version(label.split(" ")[0]),
                           "error": missing, "needed_by": needed_by, "carried": carried}
    env["packages"] = packages
    return env


def _version(dist_name: str) -> Optional[str]:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------------ the orchestrator

def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected checks within the budget (see the module docstring); returns the report as a dict."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = args.budget if args.budget is not None else (DRY_BUDGET_S if args.dry_run else GPU_BUDGET_S)
    start = time.time()
    deadline = start + budget
    selected = [c for c in CHECKS if not args.only or c.name in args.only]
    work = Path(tempfile.mkdtemp(prefix="disttrain-gpu-check-"))
    progress = out / "progress.jsonl"
    progress.write_text("")
    log = open(out / "log.txt", "w")
    rows: list[dict] = []
    env: dict[str, Any] = {}
    pending = [c.name for c in selected]
    try:
        while pending:
            pending, env = run_worker(args, pending, deadline, work, progress, log, rows, env)
    finally:
        log.close()
        shutil.rmtree(work, ignore_errors=True)
        progress.unlink(missing_ok=True)
    return {"date": dt.datetime.now().isoformat(timespec="seconds"), "dry_run": args.dry_run, "budget_s": budget,
            "wall_s": round(time.time() - start, 1), "env": env, "rows": rows,
            "checks": [{"name": c.name, "label": c.label, "what": c.what, "expected_s": c.expected_s,
                        "budget_s": c.budget_s} for c in selected]}


def run_worker(args: argparse.Namespace, names: list[str], deadline: float, work: Path, progress: Path, log: Any,
               rows: list[dict], env: dict) -> tuple[list[str], dict]:
    """One worker over ``names``; returns the names still to run (after a stopped or crashed check) and the env."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--progress", str(progress), "--deadline",
           str(deadline), "--work", str(work), *(["--dry-run"] if args.dry_run else []),
           *(["--skip-env"] if env else []), *names]
    log.write(f"\n=== worker: {' '.join(names)}\n")
    log.flush()
    # A session of its own: a check's own children (recipes, torchrun) are stopped with it.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    offset = progress.stat().st_size
    current: Optional[str] = None
    started = 0.0
    done: set[str] = set()
    while True:
        exited = proc.poll() is not None
        with open(progress) as f:
            f.seek(offset)
            chunk = f.read()
        complete = chunk[:chunk.rfind("\n") + 1]
        offset += len(complete.encode())
        for line in complete.splitlines():
            event = json.loads(line)
            if event["event"] == "env":
                env = event["env"]
            elif event["event"] == "start":
                current, started = event["check"], time.time()
            elif event["event"] == "row":
                rows.append(event["row"])
                print(_row_line(event["row"]), flush=True)
            elif event["event"] == "end":
                done.add(event["check"])
                current = None
        if exited:
            break
        now = time.time()
        limit = check_budget(BY_NAME[current], args.dry_run) if current is not None else None
        if now > deadline or (limit is not None and now - started > limit):
            _stop(proc)
            if current is not None:
                over = now - started > limit
                reason = (f"stopped after {now - started:.0f} s: over its budget of {limit:.0f} s" if over else
                          f"stopped after {now - started:.0f} s: the run's budget ran out")
                rows.append(_stopped_row(BY_NAME[current], reason, failed=over, seconds=now - started))
                print(_row_line(rows[-1]), flush=True)
                done.add(current)
            rest = [n for n in names if n not in done and not _has_row(rows, n)]
            if now > deadline:  # nothing more starts
                for name in rest:
                    rows.append(_stopped_row(BY_NAME[name], "not started: the run's budget ran out", failed=False,
                                             seconds=0.0))
                return [], env
            return rest, env
        time.sleep(POLL_S)
    if current is not None:  # the worker died inside a check
        tail = _log_tail(log)
        rows.append(_stopped_row(BY_NAME[current], f"the worker died (exit {proc.returncode}) in this check: {tail}",
                                 failed=True, seconds=time.time() - started))
        done.add(current)
        return [n for n in names if n not in done], env
    if proc.returncode != 0:  # between checks: the worker itself broke (an import, say)
        for name in names:
            if name not in done:
                rows.append(_stopped_row(BY_NAME[name], f"the worker exited with {proc.returncode}: "
                                                        f"{_log_tail(log)}", failed=True, seconds=0.0))
    return [], env


def check_budget(check: Check, dry: bool) -> float:
    """Seconds a check may run: its GPU budget, or on a CPU dry run (tiny sizes, but a shared 2-core machine where
    every process start costs seconds) a generous multiple of it."""
    return max(3 * check.budget_s, 300.0) if dry else check.budget_s


def _has_row(rows: list[dict], name: str) -> bool:
    return any(r["check"] == BY_NAME[name].label for r in rows)


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _stopped_row(check: Check, reason: str, failed: bool, seconds: float) -> dict:
    row = not_started(check, reason).to_json()
    row.update(status="fail" if failed else "skipped", ok=False if failed else None, seconds=round(seconds, 1))
    return row


def _log_tail(log: Any) -> str:
    log.flush()
    try:
        lines = [line for line in Path(log.name).read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-3:])[-500:]


def _row_line(row: dict) -> str:
    return f"[{row['status']:>7}] {row['check']}: {row['item']}: {row['figure']}" + (
        f" ({row['reason']})" if row.get("reason") else "")


# ------------------------------------------------------------------------------------------------ the report

def markdown(report: dict[str, Any]) -> str:
    env = report["env"]
    rows = report["rows"]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "skipped", "dry")}
    machine = (f"{env.get('gpu')} ({env.get('gpu_memory_gib')} GiB, compute capability {env.get('capability')}, "
               f"driver {env.get('driver', '?')})" if env.get("gpu") else f"CPU only ({env.get('cpus')} cores)")
    lines = [f"# disttrain GPU check{' (DRY RUN on CPU)' if report['dry_run'] else ''}", "",
             f"- date: {report['date']}", f"- machine: {machine}; host {env.get('host_memory_gib', '?')} GiB, "
             f"{env.get('cpus')} CPUs",
             f"- stack: Python {env.get('python')}, torch {env.get('torch')} (CUDA {env.get('cuda')}), lightning "
             f"{env.get('lightning')}, transformers {env.get('transformers')}, timm {env.get('timm')}",
             f"- run: {report['wall_s']:.0f} s of a {report['budget_s']:.0f} s budget; {counts['pass']} pass, "
             f"{counts['fail']} fail, {counts['skipped']} skipped"
             + (f", {counts['dry']} dry (device figures on CPU: not judged)" if report["dry_run"] else ""), ""]
    if report["dry_run"]:
        lines += ["A dry run measures tiny models on the CPU: it proves the script runs; its device figures (MFU, "
                  "memory, speed-ups) mean nothing and are not judged (status `dry`). Numerics (losses, counts) are "
                  "judged.", ""]
    lines += ["| check | what | figure | target | status | reason | s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["check"], r["item"], r["figure"], r["target"], f"**{r['status']}**", r.get("reason") or "",
                 "" if r.get("seconds") is None else f"{r['seconds']:.0f}"]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += ["", "## Packages the machine lacks", "", "| package | needed by | here | brought by make gpu-wheels? |", "|---|---|---|---|"]
    for label, info in env.get("packages", {}).items():
        here = f"yes ({info['version']})" if info["available"] else f"no: {info['error']}"
        lines.append("| " + " | ".join(_cell(c) for c in (label, info["needed_by"], here, info["carried"])) + " |")
    profiles = [(r, r["details"]["profile"]) for r in rows if isinstance(r.get("details"), dict)
                and "profile" in r["details"]]
    for r, prof in profiles:
        lines += ["", f"## Profile: {r['item']}", "", f"{prof['what']}; device busy {prof['busy_fraction']:.0%} of "
                  f"{prof['wall_ms']:.0f} ms; by family: "
                  + ", ".join(f"{k} {v:.0%}" for k, v in prof["families"].items()), "",
                  "| kernel | ms | share | calls |", "|---|---|---|---|"]
        lines += [f"| {_cell(k['name'])} | {k['ms']:.2f} | {k['share']:.1%} | {k['calls']} |" for k in prof["top"]]
    lines += ["", "Checks and budgets (seconds: usual / at most):", ""]
    lines += [f"- {c['label']}: {c['what']} ({c['expected_s']:.0f} / {c['budget_s']:.0f})" for c in report["checks"]]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def write_report(report: dict[str, Any], out: Path) -> None:
    """report.json and report.md, each written to a temporary name first and then renamed into place."""
    for name, text in (("report.json", json.dumps(report, indent=1, default=str)), ("report.md", markdown(report))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


# ---------------------------------------------------------------------------------------------------- main

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for report.md, report.json and log.txt")
    p.add_argument("--dry-run", action="store_true", help="every check on the CPU with tiny sizes (CI)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the whole run (default {GPU_BUDGET_S:.0f}; dry run {DRY_BUDGET_S:.0f})")
    p.add_argument("--only", nargs="+", choices=[c.name for c in CHECKS], help="run these checks only")
    p.add_argument("--list", action="store_true", help="print the checks and their budgets")
    # The worker's own options.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--progress", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--skip-env", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("names", nargs="*", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.list:
        for c in CHECKS:
            print(f"{c.name:<10} {c.label:<24} usual {c.expected_s:>4.0f} s, at most {c.budget_s:>4.0f} s  {c.what}")
        return 0
    if not args.out:
        print("gpu_check.py: error: --out DIR is required (the report is written there)", file=sys.stderr)
        return 2
    report = orchestrate(args)
    write_report(report, Path(args.out))
    failed = [r for r in report["rows"] if r["status"] == "fail"]
    print(f"report: {Path(args.out) / 'report.md'} ({len(report['rows'])} rows, {len(failed)} failed, "
          f"{report['wall_s']:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
