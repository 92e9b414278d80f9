"""async_checkpoint=True: the same folders as synchronous saves, bitwise resumes, a kill while a save is in flight,
a full disk in the background write, refusals. One kill run and one comparison run on 2 CPU processes (gloo)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT, run_dist, run_torchrun

from disttrain.parallel import registry
from disttrain.parallel.checkpoint import io as ckpt
from disttrain.parallel.checkpoint.async_save import HOLD_ENV, AsyncSaver
from disttrain.parallel.checkpoint.integrity import verify_checkpoint
from disttrain.parallel.checkpoint.io import CheckpointError, check_checkpoint, latest_checkpoint
from disttrain.parallel.guards.diskspace import FAIL_ENV, DiskFullError

STRATEGIES = ("disttrain_fsdp", "disttrain_ddp", "disttrain_megatron")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The kill run (every rank SIGKILLed while step-000002 is written in the background), then the comparison run,
    which also resumes from what the kill run left."""
    killed = tmp_path_factory.mktemp("killed") / "ckpts"
    proc = run_torchrun(str(ROOT / "tests/dist/async_checkpoint.py"), str(killed.parent / "out"), "kill",
                        str(killed), run_env={HOLD_ENV: "2"}, timeout=600)
    result = run_dist("async_checkpoint.py", tmp_path_factory.mktemp("async"), "compare", str(killed))[0]
    return proc, killed, result


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGIES)
def test_async_saves_write_the_same_folders_and_resume_bitwise(runs, name):
    got = runs[2][name]
    assert got["losses_equal"]  # training is not disturbed by the background write
    assert got["folders"][0] == got["folders"][1] == ["step-000001", "step-000002", "step-000003"]
    assert got["files"][0] == got["files"][1]
    assert got["same_folders"]  # shards, meta.pt and manifest checksums as a synchronous save's
    assert got["resumed_losses"][0] == got["resumed_losses"][1]
    assert got["state_bitwise"] and got["state_count"] > 0  # parameters and optimizer moments, after load and after


@pytest.mark.slow
def test_trainer_model_checkpoint_saves_asynchronously(runs):
    got = runs[2]
    assert got["trainer_sync"] == got["trainer_async"] == ["step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]
    assert got["trainer_same_folders"]  # complete (manifest) once fit returned, and the same shards


@pytest.mark.slow
def test_kill_during_an_async_save_resumes_from_the_previous_checkpoint(runs):
    proc, killed, result = runs
    assert proc.returncode != 0 and "SIGKILL with step-000002 in flight" in proc.stdout, proc.stdout[-3000:]
    assert result["killed_left"] == [".step-000002.tmp", "step-000001"]
    assert result["killed_latest"] == "step-000001"  # the held save's temp folder is not taken for a checkpoint
    assert latest_checkpoint(killed) == killed / "step-000001"
    with pytest.raises(CheckpointError, match=r"step-000002.tmp' is incomplete .*missing meta.pt"):
        check_checkpoint(killed / ".step-000002.tmp")
    assert result["killed_matches_sync"]  # what was saved before the kill is the synchronous run's step 1
    assert result["killed_resumed_losses"][0] == result["killed_resumed_losses"][1]
    assert result["killed_state_bitwise"]


@pytest.mark.slow
def test_a_full_disk_during_the_background_write_is_the_synchronous_line(runs):
    got = runs[2]["full_disk"]
    assert got["True"] == got["False"], got
    assert got["True"].startswith("DiskFullError: disk full while writing the checkpoint's shards") and \
        "\n" not in got["True"]
    assert got["True_left"] == got["False_left"] == []  # no half folder left behind


def test_one_process_async_save_is_the_synchronous_folder_and_its_full_disk_line(tmp_path, monkeypatch):
    """One process, no process group: the same files and checksums (shards, meta.pt); a full disk at each write of
    the background (shards, meta.pt, manifest) raises the synchronous save's line at the next save, keeps the previous
    checkpoint verifying and leaves no temporary folder."""
    saver = AsyncSaver()
    state = {"w": torch.arange(6.0), "step": 1}
    ckpt.save_sharded(tmp_path / "sync" / "ckpt", {"model": state}, {"step": 1})
    ckpt.save_sharded(tmp_path / "async" / "ckpt", {"model": state}, {"step": 1}, saver=saver)
    state["w"] += 100  # after the save returned: not in the checkpoint
    saver.wait()
    files = [json.loads((tmp_path / kind / "ckpt" / "manifest.json").read_text())["files"] for kind in ("sync", "async")]
    assert files[0].keys() == files[1].keys() and files[0]["meta.pt"] == files[1]["meta.pt"]
    assert files[0]["__0_0.distcp"] == files[1]["__0_0.distcp"]
    path = tmp_path / "async" / "ckpt"
    for point in ("shard", "metadata", "manifest"):
        monkeypatch.setenv(FAIL_ENV, point)
        with pytest.raises(DiskFullError) as sync_error:
            ckpt.save_sharded(tmp_path / "sync" / "ckpt", {"model": {"w": torch.zeros(6)}}, {"step": 2})
        ckpt.save_sharded(path, {"model": {"w": torch.zeros(6)}}, {"step": 2}, saver=saver)  # returns: in flight
        with pytest.raises(DiskFullError) as async_error:
            saver.wait()
        monkeypatch.delenv(FAIL_ENV)
        assert str(async_error.value) == str(sync_error.value).replace(str(tmp_path / "sync"), str(tmp_path / "async"))
        assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]
        verify_checkpoint(path)
        assert ckpt.read_meta(path)["step"] == 1
    saver.close()


def test_a_stager_that_closes_itself_after_staging_is_replaced(tmp_path, monkeypatch):
    """Some torch releases (2.11) close DefaultStager after every stage, which empties its copier's dispatch table:
    the next stage of a state holding a class object (a DTensor's mesh and placements) raised KeyError: <class 'type'>.
    The saver stages each save after such a close with a new stager."""
    import numbers

    from torch.distributed.checkpoint.staging import DefaultStager

    from disttrain.parallel.checkpoint.async_save import stager_closed_itself

    staged = DefaultStager._stage

    def stage_then_close(self, state_dict, **kwargs):
        result = staged(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return result

    saver = AsyncSaver()
    state = {"w": torch.arange(6.0), "kind": numbers.Number}  # its metaclass is ABCMeta, as DeviceMesh's is not type
    ckpt.save_sharded(tmp_path / "a", {"model": state}, {"step": 1}, saver=saver)
    assert not stager_closed_itself(saver._stager)  # this torch's stager keeps its buffers
    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)
    for name in ("b", "c"):
        ckpt.save_sharded(tmp_path / name, {"model": state}, {"step": 1}, saver=saver)
    saver.close()
    verify_checkpoint(tmp_path / "c")


@pytest.mark.parametrize("name, options, message", [
    ("disttrain_fsdp", {"async_checkpoint": True, "save_distributed_checkpoint": False},
     "async_checkpoint=True writes sharded checkpoints in the background, but save_distributed_checkpoint=False"),
    ("disttrain_megatron", {"async_checkpoint": True, "save_distributed_checkpoint": False},
     "async_checkpoint=True writes sharded checkpoints in the background"),
    ("disttrain_zero3", {"async_checkpoint": True},
     "async_checkpoint=True is not offered on disttrain_zero3: its checkpoints hold DeepSpeed's partitions"),
    ("disttrain_recsys", {"async_checkpoint": True}, "async_checkpoint"),
])
def test_unsupported_combinations_are_refused_in_one_line(name, options, message):
    with pytest.raises((ValueError, TypeError)) as error:
        registry.lookup(name).options(**options)
    assert message in str(error.value) and "\n" not in str(error.value)
