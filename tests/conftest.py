"""Helpers for multi-process tests: launch a script under torchrun on CPU/gloo and read each rank's result."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = Path(__file__).parent / "dist"
sys.path.insert(0, str(DIST))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    return env


def run_dist(script: str, out_dir: Path, *args: str, nproc: int = 2, timeout: int = 600) -> list[dict]:
    """Run tests/dist/<script> on ``nproc`` CPU processes; return the per-rank JSON results (rank order)."""
    out = out_dir / "result"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(DIST / script), str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-8000:]}")
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(nproc)]


# Runs shared by several test modules: each launches 2 processes once per session (reused across modules).
def launch(tmp_path_factory, script: str, *args: str) -> list[dict]:
    return run_dist(script, tmp_path_factory.mktemp(script.split(".")[0]), *args, nproc=2)


@pytest.fixture(scope="session")
def trainer_fsdp(tmp_path_factory):
    return launch(tmp_path_factory, "trainer_fsdp.py", "disttrain_fsdp")


@pytest.fixture(scope="session")
def trainer_fsdp_full_file(tmp_path_factory):
    return launch(tmp_path_factory, "trainer_fsdp.py", "disttrain_fsdp:save_distributed_checkpoint=false")


@pytest.fixture(scope="session")
def fabric_fsdp(tmp_path_factory):
    return launch(tmp_path_factory, "fabric_fsdp.py", "disttrain_fsdp")


@pytest.fixture(scope="session")
def trainer_ddp(tmp_path_factory):
    return launch(tmp_path_factory, "trainer_fsdp.py", "disttrain_ddp")


@pytest.fixture(scope="session")
def fabric_ddp(tmp_path_factory):
    return launch(tmp_path_factory, "fabric_fsdp.py", "disttrain_ddp")


@pytest.fixture(scope="session")
def trainer_zero3(tmp_path_factory):
    return launch(tmp_path_factory, "trainer_fsdp.py", "disttrain_zero3")


@pytest.fixture(scope="session")
def fabric_zero3(tmp_path_factory):
    return launch(tmp_path_factory, "fabric_fsdp.py", "disttrain_zero3")


def relative_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
