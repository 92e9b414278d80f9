"""Helpers for multi-process tests: launch a script under torchrun on CPU/gloo and read each rank's result."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from zygote import FORKS_VAR, Launcher, freeze_imported, importing_without_gc, rank_env

from disttrain import ports

pytest_plugins = ["scheduling"]  # how make test's workers share the files (tests/scheduling.py)

ROOT = Path(__file__).resolve().parents[1]
DIST = Path(__file__).parent / "dist"
sys.path.insert(0, str(DIST))
# DeepSpeed JIT-builds its ops (CPU Adam, ...) into TORCH_EXTENSIONS_DIR when a ZeRO run needs one. The default,
# ~/.cache/torch_extensions, is shared by every virtual environment on the machine, and the build's command line
# names the environment's paths: two environments in turn rebuild it for each other (a minute of CPU each time).
# One folder per environment in this checkout: built once, then reused by every run of the session and the next.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(
    ROOT / ".cache" / "torch_extensions" / hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]))
# Compiled blocks (compile=True) go to one inductor cache for the whole session, in this checkout (.cache/ is ignored):
# a test or bench compiling a graph another one compiled loads it (still compiled code: only inductor's work is
# saved), and the suite's next run reuses it. Set here, before any launch, because the zygotes serve only launches
# with the environment they started in: a variable a test added later would send its ranks to torchrun.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "torchinductor"))
# OpenMP threads that run out of work sleep at once instead of spinning first (libgomp's default: they busy-wait for
# the next parallel region): two workers on 2 cores, each with torch's default threads, spin on cores the other
# worker's processes wait for. Set before anything imports torch (libgomp reads it when loaded); the processes the
# tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
assert "torch" not in sys.modules, "conftest.py sets OMP_WAIT_POLICY before torch is imported"
# Every Python process the tests start imports tests/site/sitecustomize.py first: a larger youngest generation for
# the cyclic GC, which otherwise spends ~12% of a fresh interpreter's imports (see that file).
SITE = str(Path(__file__).parent / "site")
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE]
os.environ["PYTHONPATH"] = os.pathsep.join([SITE, *_paths])
# "torchrun": every rank of run_dist a fresh interpreter under torchrun, as a user launches the scripts.
LAUNCHER = os.environ.get("DISTTRAIN_TEST_LAUNCHER", "zygote")
_launcher = Launcher(ROOT, Path(tempfile.mkdtemp(prefix="disttrain-ranks-")))


def worker_ports() -> range:
    """This pytest worker's own ports for its rendezvous stores: a share of the 9,000 below the ports a launcher
    picks by default (disttrain.ports), which lie below the kernel's ephemeral range, and away from torchrun's
    default ports (29400, 29500). Another worker's test, or a connection's local port, never takes one between
    its pick and its store's listen (bind(0) picked from the ephemeral range: EADDRINUSE at rendezvous)."""
    top = ports.ephemeral_ports().start - ports.SPAN - 1000
    tests = range(max(1024, top - 9000), top)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    share = len(tests) // workers
    return range(tests.start + worker * share, tests.start + (worker + 1) * share)


def free_port() -> int:
    return ports.free_port(within=worker_ports())


def child_env() -> dict[str, str]:
    """The environment of the processes the tests start: this one's, with the virtual environment's commands first
    on PATH (``disttrain``, ``lightning``, ``python``: as in an activated environment, where the documented commands
    run), one OpenMP thread and no launcher variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    commands = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([commands, *(p for p in env.get("PATH", "").split(os.pathsep) if p != commands)])
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    forks = _launcher.forks(env=env) if LAUNCHER != "torchrun" else None
    if forks is not None:  # a launcher a test starts (torchrun, `disttrain run`, `lightning run model`) starts its
        # ranks with PYTHON_EXEC (torch.distributed.run): the stand-in of tests/forward.py, which has them forked
        env.update({"PYTHON_EXEC": forks["python"], FORKS_VAR: json.dumps(forks)})
    return env


def shared_launcher(env: dict[str, str]) -> Launcher | None:
    """The session's zygotes for launches in ``env`` from any thread (several may launch through them at once), or
    None where every process is to start fresh (DISTTRAIN_TEST_LAUNCHER=torchrun) or the zygotes imported their
    modules in another environment."""
    return _launcher if LAUNCHER != "torchrun" and _launcher.serves(env) else None


# Launch variables a rank's environment gets from its launcher; a process a test starts must not inherit them.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT")


_current_is_slow = True  # whether the test being run is marked slow (run_dist refuses to launch otherwise)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test, its fixtures' setup included, starts from the environment the one before it started from. An
    in-process Trainer or Fabric run sets LOCAL_RANK, WORLD_SIZE, NODE_RANK... in os.environ and leaves them: a
    later `--devices 2` script then takes itself for an already-launched rank 0 and waits for a peer nobody
    starts, which happened only in some test orders."""
    global _current_is_slow
    saved = dict(os.environ)
    _current_is_slow = item.get_closest_marker("slow") is not None
    try:
        return (yield)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_dist(script: str, out_dir: Path, *args: str, nproc: int = 2, timeout: int = 600,
             launcher: str | None = None, full_exit: bool = False, hosts=None) -> list[dict]:
    """Run tests/dist/<script> on ``nproc`` CPU processes; return the per-rank JSON results (rank order).

    The ranks are forked from pre-imported zygotes (tests/zygote.py: the same processes as torchrun's, seconds of
    imports cheaper); ``launcher="torchrun"`` or DISTTRAIN_TEST_LAUNCHER=torchrun runs them under torchrun. They
    end without the interpreter's teardown of the modules (zygote.run_and_exit: what is tested is what they
    wrote); ``full_exit=True`` where the exit itself is. ``hosts``: tools/hosts.py's hosts (network namespaces),
    as many ranks on each, node by node, in the host's network, under its name (a forked rank enters its host,
    keeping the machine's pid namespace); under torchrun, one agent per host (the rendezvous at host 0)."""
    if not _current_is_slow:
        pytest.fail(f"this test launches {script} on {nproc} processes: mark it @pytest.mark.slow, so that "
                    "`make test-fast` stays a quick loop (CI runs slow tests too)")
    out = out_dir / "result"
    env = child_env()
    fresh = (launcher or LAUNCHER) == "torchrun" or not _launcher.serves(env)
    if fresh and hosts is not None:
        procs = [hosts.popen(i, [sys.executable, "-m", "torch.distributed.run", f"--nnodes={hosts.count}",
                                 f"--node-rank={i}", f"--nproc_per_node={nproc // hosts.count}",
                                 f"--master_addr={hosts.main}", f"--master_port={HOSTS_PORT}", str(DIST / script),
                                 str(out), *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for i in range(hosts.count)]
        for i, proc in enumerate(procs):
            output = proc.communicate(timeout=timeout)[0]
            if proc.returncode != 0:
                pytest.fail(f"{script} {' '.join(args)} failed on host {i} (exit {proc.returncode}):\n"
                            f"{output[-8000:]}")
    elif fresh:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(DIST / script), str(out), *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            pytest.fail(f"{script} {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                        f"{proc.stderr[-8000:]}")
    else:
        logs = _launcher.logs(script, nproc)
        nodes = None if hosts is None else [{"placement": hosts.placement(i), "env": hosts.variables(i)}
                                            for i in range(hosts.count)]
        try:
            codes = _launcher.run([str(DIST / script), str(out), *args], env, nproc,
                                  free_port() if hosts is None else HOSTS_PORT, logs, timeout, full_exit=full_exit,
                                  hosts=nodes)
        except TimeoutError as timeout_error:
            pytest.fail(f"{timeout_error}\n{rank_logs(logs)}")
        if any(codes):
            pytest.fail(f"{script} {' '.join(args)} failed (exit codes {codes}):\n{rank_logs(logs)}")
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(nproc)]


HOSTS_PORT = 29500  # the rendezvous port on host 0 of tools/hosts.py's hosts: a network stack of its own, all free


def run_python(*argv: str, env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python argv...`` (a script and its arguments, or ``-m module ...``) as one plain process in the repository
    root, stdout and stderr captured, as ``subprocess.run`` would give it. Forked from a pre-imported zygote
    (tests/zygote.py: seconds of imports cheaper per run); ``env``: variables the program reads only after its
    imports (a test's crash point), on top of ``child_env()``."""
    base, run_env = child_env(), dict(env or {})
    if shared_launcher(base) is None:
        return subprocess.run([sys.executable, *argv], cwd=ROOT, env={**base, **run_env}, capture_output=True,
                              text=True, timeout=timeout)
    return _launcher.run_one(list(argv), base, run_env, timeout)


def run_torchrun(script: str, *args: str, nproc: int = 2, run_env: dict[str, str] | None = None,
                 timeout: float = 900, nodes: int = 1, hosts: list[dict] | None = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node N script args`` on one node (CPU), the ranks forked from the zygotes
    (tests/zygote.py); stdout and stderr are the ranks' in rank order, as torchrun's console shows them, the exit
    code the first failing rank's. ``run_env``: variables the script reads only after its imports. ``nodes``: the
    ``nproc`` ranks split over that many nodes of this machine (torchrun's variables of a multi-node run, one
    rendezvous on 127.0.0.1). ``hosts``: the nodes are these, as ``Launcher.run`` takes them (tools/hosts.py's hosts;
    forked ranks only: run_launched starts the launcher on each host otherwise)."""
    base = child_env()
    fresh = shared_launcher(base) is None
    assert not (fresh and hosts), "run_launched(hosts=...) starts a launcher on each host for fresh processes"
    if fresh and nodes > 1:  # fresh processes with torchrun's variables
        port, errors = free_port(), Path(tempfile.mkdtemp(prefix="disttrain-nodes-"))
        procs = [subprocess.Popen([sys.executable, script, *args], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env={**rank_env(base, rank, nproc, port,
                                                                          str(errors / f"{rank}.json"), nodes),
                                                               **(run_env or {})}) for rank in range(nproc)]
        try:
            return completed([script, *args], procs, timeout)
        finally:
            shutil.rmtree(errors, ignore_errors=True)
    if fresh:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", script, *args]
        return subprocess.run(cmd, cwd=ROOT, env={**base, **(run_env or {})}, capture_output=True, text=True,
                              timeout=timeout)
    logs = _launcher.logs(Path(script).stem, 2 * nproc)
    outs, errs = logs[:nproc], logs[nproc:]
    try:
        codes = _launcher.run([str(ROOT / script), *args], base, nproc, HOSTS_PORT if hosts else free_port(), outs,
                              timeout, run_env=run_env, errs=errs, hosts=hosts or ([{}] * nodes if nodes > 1 else None))
    except TimeoutError:
        raise subprocess.TimeoutExpired(script, timeout) from None
    read = lambda files: "".join(f.read_text(errors="replace") for f in files if f.exists())  # noqa: E731
    return subprocess.CompletedProcess([script, *args], Launcher.exit_code(codes), read(outs), read(errs))


def run_launched(script: str, *args: str, devices: int = 2, strategy: str | None = None, accelerator: str = "cpu",
                 precision: str | None = None, timeout: float = 900, run_env: dict[str, str] | None = None,
                 hosts=None, nodes: int = 1) -> subprocess.CompletedProcess:
    """``lightning run model --accelerator A --devices N [--strategy S] [--precision P] script args`` on one node:
    the ranks get the LT_* variables the launcher sets (disttrain.cli.launch) besides torchrun's (run_torchrun).
    ``hosts``: on the first ``nodes`` of tools/hosts.py's hosts, ``devices`` ranks each, as ``disttrain run
    --num-nodes NODES --node-rank I --main-address HOST0`` on each starts them (under torchrun: that command).
    Tests of the launcher itself (tests/test_cli.py, the documented commands) start the real command."""
    launcher_env = {"LT_CLI_USED": "1", "LT_DEVICES": str(devices), "LT_NUM_NODES": str(nodes),
                    "LT_ACCELERATOR": accelerator}
    launcher_env.update({k: v for k, v in (("LT_STRATEGY", strategy), ("LT_PRECISION", precision)) if v is not None})
    base = child_env()
    if shared_launcher(base) is None:
        flags = [f"--{k}={v}" for k, v in (("accelerator", accelerator), ("devices", devices), ("strategy", strategy),
                                           ("precision", precision)) if v is not None]
        if hosts is None:
            return subprocess.run([str(Path(sys.executable).parent / "lightning"), "run", "model", *flags,
                                   f"--main-port={free_port()}", script, *args], cwd=ROOT,
                                  env={**base, **(run_env or {})}, capture_output=True, text=True, timeout=timeout)
        procs = [hosts.popen(i, [str(Path(sys.executable).parent / "disttrain"), "run", f"--num-nodes={nodes}",
                                 f"--node-rank={i}", f"--main-address={hosts.main}", *flags, script, *args],
                             env={**base, **(run_env or {})}, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(nodes)]
        return completed([script, *args], procs, timeout)
    placed = None if hosts is None else [{"placement": hosts.placement(i), "env": hosts.variables(i)}
                                         for i in range(nodes)]
    return run_torchrun(script, *args, nproc=devices * nodes, run_env={**launcher_env, **(run_env or {})},
                        timeout=timeout, hosts=placed)


def completed(argv: list[str], procs: list[subprocess.Popen], timeout: float) -> subprocess.CompletedProcess:
    """The processes of one launch (a rank or a host each) as one: their stdout and stderr in order, the exit code
    the launch's (``Launcher.exit_code``)."""
    outputs = [proc.communicate(timeout=timeout) for proc in procs]
    return subprocess.CompletedProcess(argv, Launcher.exit_code([p.returncode for p in procs]),
                                       "".join(o for o, _ in outputs), "".join(e for _, e in outputs))


def rank_logs(logs: list[Path], tail: int = 6000) -> str:
    return "\n".join(f"--- rank {rank} ---\n{log.read_text(errors='replace')[-tail:]}"
                     for rank, log in enumerate(logs) if log.exists())


def pytest_configure(config) -> None:
    """No cyclic GC while the test files are imported (torch, Lightning, transformers, DeepSpeed...), in the process
    that collects them (a worker, or the run without workers; xdist's controller imports none); collection done,
    what they imported is frozen out of later collections (zygote.importing_without_gc, freeze_imported)."""
    if "PYTEST_XDIST_WORKER" in os.environ or not getattr(config.option, "numprocesses", None):
        importing_without_gc()


def pytest_collection_finish(session) -> None:
    if not gc.isenabled():  # pytest_configure disabled it
        freeze_imported()


def pytest_sessionfinish(session) -> None:
    gc.enable()  # also when collection failed
    _launcher.close()
    shutil.rmtree(_launcher.log_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that starts a process group in this process (a one-device Fabric or Trainer under a disttrain strategy)
    leaves none for the next: the simulator's fake groups need a process without one. Groups a module- or
    session-scoped fixture started (there before the test) are left alone."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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


@pytest.fixture(scope="session")
def trainer_zero2(tmp_path_factory):
    return launch(tmp_path_factory, "trainer_fsdp.py", "disttrain_zero2")


@pytest.fixture(scope="session")
def fabric_zero2(tmp_path_factory):
    return launch(tmp_path_factory, "fabric_fsdp.py", "disttrain_zero2")


def exported_probe_logits(ckpt: Path, out: Path, *flags: str):
    """``disttrain export CKPT OUT FLAGS`` (a checkpoint of tests/dist's tiny Llama; a Trainer's needs ``--prefix
    model.``), loaded into a plain model of another seed: its logits on ``probe_input()``."""
    import torch
    from safetensors.torch import load_file

    from common import probe_input, tiny_llama

    proc = run_python("-m", "disttrain.cli", "export", str(ckpt), str(out), *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = tiny_llama(seed=99)
    plain.load_state_dict(load_file(out))
    with torch.no_grad():
        return plain(input_ids=probe_input()).logits


def relative_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
