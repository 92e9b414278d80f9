"""Benchmarks cannot rot unseen: every script in ``bench/`` runs here with ``--smoke`` (tiny sizes, a few steps) and
must exit 0 and print its table. The scripts are found, not listed: a bench added later is covered the day it lands,
and one without ``--smoke`` fails with what to add. Only their completion is checked, never their figures or time.

Helper modules (no ``if __name__ == "__main__":``) are not benches; ``gpu_check.py`` has its own test (its dry run).
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import ROOT, child_env

BENCH = ROOT / "bench"
OWN_TEST = {"gpu_check.py": "tests/test_gpu_check.py"}
# Two benches at once: each is a few processes that spend much of their time importing and in rendezvous and gloo
# waits, so a second one beside it shortens the whole (as make test's two workers do).
PARALLEL = 2


def bench_scripts() -> list[str]:
    return sorted(p.name for p in BENCH.glob("*.py")
                  if p.name not in OWN_TEST and 'if __name__ == "__main__":' in p.read_text())


def smoke(name: str, out_dir: Path) -> tuple[subprocess.CompletedProcess, float, Path]:
    """``python bench/NAME --smoke [--out-dir OUT]`` (tables in OUT, not in bench/out) as a user starts it: the
    completed process, its seconds and OUT. (A fresh interpreter: the bench itself imports little; its ranks are
    its own torchrun's.)"""
    args = ["--out-dir", str(out_dir)] if "--out-dir" in (BENCH / name).read_text() else []
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(BENCH / name), "--smoke", *args], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=600)
    return proc, time.perf_counter() - start, out_dir


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory) -> dict[str, Future]:
    """The selected benches' smoke runs, started together (``PARALLEL`` at a time); each test waits for its own."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if item.path == Path(__file__) and hasattr(item, "callspec")]
    runnable = [name for name in selected if "--smoke" in (BENCH / name).read_text()]
    pool = ThreadPoolExecutor(PARALLEL)
    request.addfinalizer(pool.shutdown)
    return {name: pool.submit(smoke, name, tmp_path_factory.mktemp(Path(name).stem)) for name in runnable}


def test_discovery_finds_the_benches_and_leaves_helpers_out():
    names = bench_scripts()
    assert {"fsdp_overhead.py", "zero3_overhead.py", "attention.py"} <= set(names)
    assert not {"harness.py", "tables.py", "gpu_check.py"} & set(names)


@pytest.mark.slow
@pytest.mark.parametrize("name", bench_scripts())
def test_bench_smoke_run_completes_and_prints_its_table(name, smoke_runs):
    source = (BENCH / name).read_text()
    if "--smoke" not in source:
        pytest.fail(f"bench/{name} has no --smoke option. Every bench accepts --smoke: tiny sizes and a few steps, done"
                    " well under 60 s on 2 CPU processes, still printing its table (harness.parse_smoke adds it:"
                    " `args = parse_smoke(parser, steps=1, hidden=64, ...)`)")
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
