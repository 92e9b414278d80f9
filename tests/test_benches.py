"""Benchmarks cannot rot unseen: every script in ``bench/`` runs here with ``--smoke`` (tiny sizes, a few steps) and
must exit 0 and print its table. The scripts are found, not listed: a bench added later is covered the day it lands,
and one without ``--smoke`` fails with what to add. Only their completion is checked, never their figures or time.

Helper modules (no ``if __name__ == "__main__":``) are not benches; ``gpu_check.py`` has its own test (its dry run).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import ROOT, run_python

BENCH = ROOT / "bench"
OWN_TEST = {"gpu_check.py": "tests/test_gpu_check.py"}
NEEDS_ROOT = {"multi_host.py"}  # its hosts are network namespaces (CI runs as root)
# Two benches at once: each is a few processes that spend much of their time importing and in rendezvous and gloo
# waits, so a second one beside it shortens the whole (as make test's two workers do).
PARALLEL = 2


def bench_scripts() -> list[str]:
    return sorted(p.name for p in BENCH.glob("*.py")
                  if p.name not in OWN_TEST and 'if __name__ == "__main__":' in p.read_text())


def smoke(name: str, out_dir: Path) -> tuple[subprocess.CompletedProcess, float, Path]:
    """``python bench/NAME --smoke [--out-dir OUT]`` (tables in OUT, not in bench/out) as a user starts it: the
    completed process, its seconds and OUT. It runs in a fork of a zygote that has imported torch, Lightning and
    the rest once (conftest.run_python: the same process a fresh interpreter would be), and a smoke run forks its
    ranks from itself (harness.torchrun): no process of a smoke run imports them again."""
    argv = [str(BENCH / name), "--smoke", *(["--out-dir", str(out_dir)] if "--out-dir" in (BENCH / name).read_text()
                                            else [])]
    start = time.perf_counter()
    proc = run_python(*argv, timeout=600)
    return proc, time.perf_counter() - start, out_dir


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory) -> dict[str, Future]:
    """The selected benches' smoke runs, started together (``PARALLEL`` at a time); each test waits for its own."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if item.path == Path(__file__) and hasattr(item, "callspec")]
    runnable = [name for name in selected if "--smoke" in (BENCH / name).read_text()
                and (name not in NEEDS_ROOT or os.geteuid() == 0)]
    pool = ThreadPoolExecutor(PARALLEL)  # both threads launch through the session's zygotes
    request.addfinalizer(pool.shutdown)
    return {name: pool.submit(smoke, name, tmp_path_factory.mktemp(Path(name).stem)) for name in runnable}


def test_discovery_finds_the_benches_and_leaves_helpers_out():
    names = bench_scripts()
    assert {"fsdp_overhead.py", "zero3_overhead.py", "attention.py"} <= set(names)
    assert not {"harness.py", "tables.py", "gpu_check.py"} & set(names)


# A smoke run's ranks (harness.torchrun): each writes what it saw, rank 1 fails when asked, rank 0 then waits in vain.
FORK_PARENT = """
import json, os, sys, tempfile
sys.path.insert(0, "bench")
from harness import torchrun
with tempfile.TemporaryDirectory() as tmp:
    torchrun([sys.argv[1], tmp, sys.argv[2]], 2)
    print(json.dumps({"pid": os.getpid(), "kept": os.path.isdir(tmp), "files": sorted(os.listdir(tmp)),
                      "ranks": [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(2)]}))
"""
FORK_RANK = """
import atexit, json, os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
atexit.register(lambda: open(os.path.join(sys.argv[1], os.environ["RANK"] + ".atexit"), "w").close())
total = torch.ones(1)
dist.all_reduce(total)
rank = dist.get_rank()
if sys.argv[2] == "fail":
    if rank == 1:
        sys.exit(3)
    time.sleep(600)  # stopped by the launcher when rank 1 fails
with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": dist.get_world_size(), "sum": total.item(), "ppid": os.getppid(),
               "local_rank": os.environ["LOCAL_RANK"], "argv": sys.argv[1:]}, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_smoke_runs_fork_their_ranks_and_a_failing_rank_fails_the_run(tmp_path):
    """Under --smoke a bench's ranks are forks of the bench itself (no torchrun agent, no imports again): they
    rendezvous as torchrun's do, run their exit handlers, the bench's own folders outlive them, and one rank's
    failure stops the others and fails the bench with its exit code, as torchrun would."""
    parent, rank = tmp_path / "parent.py", tmp_path / "rank.py"
    parent.write_text(FORK_PARENT)
    rank.write_text(FORK_RANK)
    proc = run_python(str(parent), str(rank), "ok", "--smoke")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    assert run["kept"], "a rank's exit removed the bench's temporary folder"
    assert run["files"] == ["0.atexit", "0.json", "1.atexit", "1.json"], run["files"]  # each rank ran its atexit
    for r, seen in enumerate(run["ranks"]):
        assert seen == {"rank": r, "world": 2, "sum": 2.0, "ppid": run["pid"], "local_rank": str(r),
                        "argv": [seen["argv"][0], "ok"]}, seen
    proc = run_python(str(parent), str(rank), "fail", "--smoke")
    assert proc.returncode != 0 and "CalledProcessError" in proc.stderr and "exit status 3" in proc.stderr, \
        proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", bench_scripts())
def test_bench_smoke_run_completes_and_prints_its_table(name, smoke_runs):
    source = (BENCH / name).read_text()
    if "--smoke" not in source:
        pytest.fail(f"bench/{name} has no --smoke option. Every bench accepts --smoke: tiny sizes and a few steps, done"
                    " well under 60 s on 2 CPU processes, still printing its table (harness.parse_smoke adds it:"
                    " `args = parse_smoke(parser, steps=1, hidden=64, ...)`)")
    if name in NEEDS_ROOT and os.geteuid() != 0:
        pytest.skip(f"bench/{name} needs root")
    proc, seconds, out_dir = smoke_runs[name].result()
    print(f"bench/{name} --smoke: {seconds:.0f} s")
    assert proc.returncode == 0, f"bench/{name} --smoke exited {proc.returncode}\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-6000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) >= 3, f"bench/{name} --smoke printed no table:\n{proc.stdout}"
    if "write_table(" in source:
        written = [line for line in lines if line.startswith("wrote ") and ".md" in line]
        assert written, f"bench/{name} --smoke did not write its table:\n{proc.stdout[-3000:]}"
        md = Path(written[-1].split()[1])
        assert "--out-dir" not in source or md.parent == out_dir, f"{md} is not in --out-dir {out_dir}"
        assert "|---" in md.read_text(), md.read_text()
