"""Mistakes are caught before any process starts: sizes the devices cannot hold and a misspelt strategy name end in
one line, inside ``Trainer(...)`` / ``Fabric(...)`` (before ``fit`` or ``launch`` could start a process) and at the
launcher (``disttrain run`` / ``lightning run model``: that line alone, no traceback, unless ``--verbose``)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import lightning as L
import pytest
import torch.distributed as dist
from conftest import ROOT, child_env, free_port, run_python, run_torchrun

import disttrain
from disttrain.parallel.options import OptionError

SIZES = (r"^disttrain_megatron cannot run on devices=2 x num_nodes=1 \(2 processes\): world_size=2 is not divisible"
         r" by tp=3; choose sizes whose product divides 2$")
LIMIT_S = 10.0  # "before any process starts" is also "at once": the checks take milliseconds once Python has started


@pytest.fixture
def no_process_may_start(monkeypatch):
    """Lightning's launchers start processes with subprocess.Popen (the script again) or multiprocessing."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    yield
    assert not (dist.is_available() and dist.is_initialized())


def one_line_error(make, error=OptionError) -> str:
    start = time.perf_counter()
    with pytest.raises(error) as info:
        make()
    assert time.perf_counter() - start < LIMIT_S
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("entry", ["trainer", "fabric"])
def test_sizes_the_devices_cannot_hold_are_one_line_before_any_process(entry, no_process_may_start):
    if entry == "trainer":
        make = lambda: L.Trainer(strategy=disttrain.strategies.MegatronStrategy(tensor_parallel_size=3),  # noqa: E731
                                 accelerator="cpu", devices=2, logger=False)
    else:
        make = lambda: L.Fabric(strategy=disttrain.fabric.MegatronStrategy(tensor_parallel_size=3),  # noqa: E731
                                accelerator="cpu", devices=2)
    assert re.match(SIZES, one_line_error(make))


@pytest.mark.parametrize("make, said", [
    (lambda: L.Fabric(strategy=disttrain.fabric.FSDPStrategy(hybrid_shard=True, shard_size=3), accelerator="cpu",
                      devices=2, num_nodes=2),
     "disttrain_fsdp cannot run on devices=2 x num_nodes=2 (4 processes): shard_size=3 does not divide world_size=4"),
    (lambda: L.Trainer(strategy=disttrain.strategies.MegatronStrategy(tensor_parallel_size=2, expert_parallel_size=2),
                       accelerator="cpu", devices=2, num_nodes=3, logger=False),
     "disttrain_megatron cannot run on devices=2 x num_nodes=3 (6 processes): ep=2 does not divide dp_shard=3"),
], ids=["fsdp-shard-size", "megatron-experts"])
def test_other_sizes_name_the_devices_the_nodes_and_the_engines_sentence(make, said, no_process_may_start):
    assert one_line_error(make).startswith(said)


@pytest.mark.parametrize("cls", [disttrain.strategies.DDPStrategy, disttrain.strategies.ZeroStrategy,
                                 disttrain.fabric.DDPStrategy, disttrain.fabric.ZeroStrategy],
                         ids=lambda c: f"{c.__module__.split('.')[1]}.{c.__name__}")
def test_the_adapters_over_lightnings_own_strategies_check_too(cls, monkeypatch, no_process_may_start):
    """DDP and ZeRO-3 sit on Lightning's DDPStrategy/DeepSpeedStrategy, whose launcher is configured by Lightning's
    code: their engine's rule is asked all the same (no size of theirs can be wrong today: a stand-in rule that
    refuses shows the question is asked, with the world Lightning set up)."""
    asked = []

    def refuse(options, world_size, local_size=None):
        asked.append((world_size, local_size))
        raise ValueError("refused for the test")

    monkeypatch.setattr(cls.engine_cls, "parallel_dims", classmethod(lambda c, *a: refuse(*a)))
    entry = L.Trainer if cls in disttrain.strategies.ADAPTERS else L.Fabric
    kwargs = {"logger": False} if entry is L.Trainer else {}
    message = one_line_error(lambda: entry(strategy=cls(), accelerator="cpu", devices=2, num_nodes=2, **kwargs))
    assert message == f"{cls.strategy_name} cannot run on devices=2 x num_nodes=2 (4 processes): refused for the test"
    assert asked == [(4, 2)]


@pytest.mark.parametrize("entry", [L.Trainer, L.Fabric], ids=["trainer", "fabric"])
def test_a_misspelt_strategy_name_suggests_the_closest(entry, no_process_may_start):
    message = one_line_error(lambda: entry(strategy="disttrain_fsdpp", accelerator="cpu", devices=2), ValueError)
    assert message.startswith("You selected an invalid strategy name: `strategy='disttrain_fsdpp'`.")  # Lightning's
    assert "; did you mean 'disttrain_fsdp'? (disttrain's strategies: disttrain_ddp, disttrain_fsdp," in message
    # a name close to Lightning's own gets Lightning's (and ours) too; one close to nothing keeps Lightning's error
    assert "did you mean 'disttrain_fsdp' or 'fsdp'?" in one_line_error(lambda: entry(strategy="fsdpp"), ValueError)
    far = one_line_error(lambda: entry(strategy="xyzzy"), ValueError)
    assert "did you mean" not in far and far.startswith("You selected an invalid strategy name")


# -- the launcher ------------------------------------------------------------------------------------------------
LIGHTNING = "import sys; from disttrain.cli import lightning_main; sys.exit(lightning_main(sys.argv[1:]))"


@pytest.mark.slow
@pytest.mark.parametrize("command", [["-m", "disttrain.cli", "run"], ["-c", LIGHTNING, "run", "model"]],
                         ids=["disttrain-run", "lightning-run-model"])
def test_the_launcher_suggests_the_closest_name_before_starting_anything(command):
    argv = [*command, "tests/dist/refused_sizes.py", "fabric", "--strategy", "disttrain_fsdpp", "--devices", "2"]
    run_python(*command[:2], "--help")  # the interpreter it is forked from has started (imports are not timed)
    start = time.perf_counter()
    proc = run_python(*argv)
    assert time.perf_counter() - start < LIMIT_S
    prog = "disttrain run" if command[0] == "-m" else "lightning run model"
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"{prog}: error: --strategy 'disttrain_fsdpp' is not a registered strategy; did you"
                                  " mean 'disttrain_fsdp'? choose one of: ")
    assert proc.stderr.count("\n") == 1 and "reached" not in proc.stdout


@pytest.mark.slow
def test_launched_processes_hand_the_line_to_the_launcher(tmp_path):
    """What the launcher's processes do (the bootstrap, each rank forked as torchrun would start it): the line in
    the launcher's folder, exit status 1, no traceback, before any rendezvous."""
    reports = tmp_path / "reports"
    reports.mkdir()
    script = ["src/disttrain/_bootstrap.py", "tests/dist/refused_sizes.py"]
    run_torchrun(*script, "fabric", run_env={"DISTTRAIN_LAUNCH_REPORTS": str(tmp_path)})  # the ranks' zygotes start
    for entry in ("trainer", "fabric"):
        start = time.perf_counter()
        proc = run_torchrun(*script, entry, run_env={"DISTTRAIN_LAUNCH_REPORTS": str(reports)})
        assert time.perf_counter() - start < LIMIT_S
        assert proc.returncode == 1 and "Traceback" not in proc.stderr and "reached" not in proc.stdout, proc.stderr
        # the rank that fails first leaves its line; the other may be ended by the launcher's SIGTERM before it
        # writes its own (as under torchrun), and a line it did write is the same one
        lines = {path.name: path.read_text() for path in reports.glob("*.txt")}
        assert lines and set(lines) <= {"attempt0.rank0.txt", "attempt0.rank1.txt"}
        assert all(re.match(SIZES, line) for line in lines.values()), lines
        for path in reports.glob("*.txt"):
            path.unlink()


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_disttrain_run_prints_that_line_alone(verbose):
    """The whole launcher, its processes fresh interpreters under torchrun: the one line, or with --verbose every
    process's traceback and torchrun's report."""
    flags = ["--verbose"] if verbose else []
    # a free --main-port: the default one may be another test's at this moment, and its notice is a line of its own
    proc = subprocess.run([sys.executable, "-m", "disttrain.cli", "run", *flags, "--main-port", str(free_port()),
                           "tests/dist/refused_sizes.py", "fabric", "--accelerator", "cpu", "--devices", "2"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "reached" not in proc.stdout
    if verbose:
        assert proc.stderr.count("Traceback") >= 2 and "ChildFailedError" in proc.stderr
        assert "OptionError: disttrain_megatron cannot run on devices=2" in proc.stderr
    else:
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and re.match(SIZES, lines[0].removeprefix("disttrain run: error: ")), \
            proc.stderr


def test_recipes_print_an_options_error_alone_unless_verbose(capsys, monkeypatch):
    """one_line_failures (the recipes): an OptionError is its line on stderr and exit status 1, printed by rank 0
    only (before any process group: $RANK); DISTTRAIN_VERBOSE=1 lets it through with its traceback."""
    from disttrain.parallel.guards.failures import one_line_failures

    def refused():
        with one_line_failures("recipe"):
            disttrain.fabric.MegatronStrategy(microbatches=4)

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        refused()
    assert exit_.value.code == 1
    assert capsys.readouterr().err == ("recipe: error: microbatches=4 applies with pipeline_parallel_size > 1; set it,"
                                       " or remove microbatches\n")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        refused()
    assert capsys.readouterr().err == ""  # rank 0 says it
    monkeypatch.setenv("DISTTRAIN_VERBOSE", "1")
    with pytest.raises(OptionError, match="microbatches=4 applies"):
        refused()
