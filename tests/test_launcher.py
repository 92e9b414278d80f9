"""The test launcher (tests/zygote.py) starts ranks that behave as torchrun's: same environment, arguments, path,
interpreter state and Lightning view, distinct hash seeds, atexit handlers run, a failing rank stops the run, and a
rank ends as the interpreter's shutdown ends a script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, child_env, run_dist, run_python

sys.path.insert(0, str(ROOT / "tools"))
from hosts import Hosts  # noqa: E402


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> dict[str, list[dict]]:
    return {launcher: run_dist("launch_env.py", tmp_path_factory.mktemp(launcher), "ok", launcher=launcher)
            for launcher in ("torchrun", "zygote")}


@pytest.mark.slow
def test_ranks_see_what_torchrun_gives(both):
    for torchrun, zygote in zip(both["torchrun"], both["zygote"]):
        assert zygote["env"] == {**torchrun["env"], "MASTER_PORT": zygote["env"]["MASTER_PORT"]}
        for key in ("script_dir_first", "name", "cwd", "threads_at_start", "threads", "stdin_empty",
                    "write_through", "rank_zero_at_import", "elastic", "lightning_elastic", "sum",
                    "session_leader", "annotations"):
            assert zygote[key] == torchrun[key], key
        assert zygote["argv"][1:] == torchrun["argv"][1:] == ["ok"]
    assert [r["rank_zero_at_import"] for r in both["zygote"]] == [0, 1]
    assert both["zygote"][0]["threads_at_start"] == 1 and both["zygote"][0]["sum"] == 3.0
    assert both["zygote"][0]["annotations"] == "{'return': None}"  # evaluated: not the zygote's __future__ import


@pytest.mark.slow
def test_each_rank_has_its_own_seeds_and_runs_its_atexit_handlers(both):
    for launcher, ranks in both.items():
        assert ranks[0]["hash"] != ranks[1]["hash"], launcher  # str hash seeds: set orders differ between ranks
        assert ranks[0]["first_random"] != ranks[1]["first_random"], launcher  # torch starts from a random seed
        assert all(Path(r["marker"]).exists() for r in ranks), launcher


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "zygote"])
def test_a_failing_rank_stops_the_run(tmp_path, launcher):
    with pytest.raises(pytest.fail.Exception, match="ValueError: rank 1 fails on purpose"):
        run_dist("launch_env.py", tmp_path, "fail", launcher=launcher, timeout=120)


@pytest.mark.slow
def test_a_rank_ends_as_a_fresh_interpreter_does(tmp_path):
    """The zygotes' ranks end without the teardown of the modules (zygote.run_and_exit), and otherwise as the
    interpreter's shutdown ends a script: sys.exit's status, a non-daemon thread finished first, a file the script
    left open flushed. One rank: of two, the first to exit with 3 has the launcher stop the other (SIGTERM, as
    torchrun does), which may still be ending."""
    with pytest.raises(pytest.fail.Exception, match=r"failed \(exit codes \[3\]\)"):
        run_dist("launch_env.py", tmp_path, "exit", nproc=1, timeout=120)
    assert (tmp_path / "result.0.open").read_text() == "written, never closed"
    assert (tmp_path / "result.0.thread").read_text() == "done"


def test_processes_the_suite_starts_import_its_site_module():
    """tests/site/sitecustomize.py runs in every process a test starts (conftest.py puts it on PYTHONPATH), and only
    changes the GC's youngest threshold."""
    code = "import gc, json, sitecustomize; print(json.dumps([gc.get_threshold(), sitecustomize.__file__]))"
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr
    threshold, path = json.loads(proc.stdout)
    assert threshold == [20000, 10, 10] and Path(path).parent.name == "site", proc.stdout


def test_launches_from_several_threads_at_once_each_get_their_own_exit_and_output():
    """Threads launching through the same zygotes at once (test_docs' and test_benches' pools): each launch waits
    for its own process, whichever thread reads the zygotes' messages, and gets its exit code and output."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int):
        code = f"import sys, time; time.sleep({0.3 * (3 - i)}); print('run {i}'); sys.exit({i})"
        return run_python("-c", code)

    with ThreadPoolExecutor(3) as pool:
        procs = list(pool.map(one, range(3)))
    assert [(p.returncode, p.stdout) for p in procs] == [(i, f"run {i}\n") for i in range(3)]


# How a process started with ``python`` ends on SIGTERM and SIGKILL: [its exit status, whether the pid it reports
# is not the one its starter holds (a fork's: the stand-in's differs), whether that process is gone after].
STOPPED = r'''
import json, os, subprocess, sys, time

def gone(pid):
    for _ in range(100):
        if not os.path.exists(f"/proc/{pid}"):  # on a host: the host's /proc, its own process ids
            return True
        time.sleep(0.1)
    return False

def stopped(python):
    ends = {}
    for how in ("terminate", "kill"):
        child = subprocess.Popen([python, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
                                 stdout=subprocess.PIPE, text=True)
        pid = int(child.stdout.readline())
        getattr(child, how)()
        ends[how] = [child.wait(), pid != child.pid, gone(pid)]
    return ends
'''

STARTS = STOPPED + r'''
def start(*args, **kwargs):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, **kwargs)

IMPORTED = "import sys; print('torch' in sys.modules)"
out = {}
proc = start("-c", IMPORTED + "; print('to stderr', file=sys.stderr); sys.exit(7)")
out["forked"] = [proc.returncode, proc.stdout, proc.stderr]
out["stdin"] = start("-c", "import sys; print(sys.stdin.read().upper())", input="hello").stdout
with open(os.devnull) as handed:
    out["fd handed down"] = start("-c", IMPORTED, pass_fds=(handed.fileno(),)).stdout
out["option"] = start("-I", "-c", IMPORTED).stdout
out["other environment"] = start("-c", IMPORTED, env={**os.environ, "DISTTRAIN_IMPORT_TIME_SETTING": "1"}).stdout
out.update(stopped(sys.executable))
print(json.dumps(out))
'''


@pytest.mark.slow
def test_what_a_forked_process_starts_with_its_interpreter_is_forked_too_where_it_would_be_the_same():
    """A program the suite forks that starts `sys.executable -c ...` (a recipe, a launcher and its ranks, Lightning's
    second rank) gets a fork of the zygotes as well (tests/forward.py): its exit status and output, its stdin, and
    the signals that stop it are those of the process it stands for; a fork of a process that another launcher
    stops with SIGKILL ends with it. Where a fork would not be the same process, the real interpreter runs: a file
    descriptor handed down, an interpreter option, an environment the zygotes did not import in."""
    proc = run_python("-c", STARTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["forked"] == [7, "True\n", "to stderr\n"]  # torch already imported: a fork
    assert out["stdin"] == "HELLO\n"
    assert out["fd handed down"] == out["option"] == out["other environment"] == "False\n"  # fresh interpreters
    assert out["terminate"] == [-15, True, True] and out["kill"] == [-9, True, True]


ON_A_HOST = STOPPED + r'''
def namespaces(pid):
    return {name: os.stat(f"/proc/{pid}/ns/{name}").st_ino for name in ("net", "uts", "mnt", "pid")}

PROBE = ("import json, os, socket, sys; print(json.dumps({'torch': 'torch' in sys.modules, 'parent': os.getppid(), "
         "'host': socket.gethostname(), 'ns': {n: os.stat(f'/proc/self/ns/{n}').st_ino for n in ('net', 'uts', "
         "'mnt', 'pid')}}))")
python = os.environ["PYTHON_EXEC"]  # as torchrun starts its workers
out = {"launcher": namespaces("self"), "probe": json.loads(subprocess.run([python, "-u", "-c", PROBE], text=True,
                                                                          capture_output=True, check=True).stdout)}
out.update(stopped(python))
print(json.dumps(out))
'''


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_what_a_process_on_a_host_starts_is_forked_into_that_host():
    """A launcher running on a host of tools/hosts.py (the multi-host tests' agents) starts its ranks through the
    stand-in: each is a fork (torch imported) that lives on that host as a process started there would, in its
    network, under its hostname, with its mounts and among its process ids; SIGTERM and SIGKILL end it as the
    process it stands for."""
    with Hosts(1, name="dtfork") as hosts:
        proc = hosts.popen(0, [sys.executable, "-c", ON_A_HOST], env=child_env(), cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    out = json.loads(stdout)
    assert out["probe"]["torch"] and out["probe"]["host"] == "host0"
    assert out["probe"]["ns"] == out["launcher"]  # the host's network, name, mounts and process ids
    assert out["probe"]["parent"] == 0  # its parent is the zygote's fork, outside the host's process ids
    assert out["terminate"] == [-15, True, True] and out["kill"] == [-9, True, True]
