"""What users bring, against Lightning's own ``ddp`` on the same data, seed and sampler (2 CPU processes, fp32):
Lightning's GAN pattern (manual optimization, two optimizers, toggle_optimizer) under the Trainer and Fabric,
calling the model after ``trainer.fit``, and ``MyModule.load_from_checkpoint(folder)`` in a fresh plain process."""

from __future__ import annotations

import json
import os
import shutil

import lightning as L
import pytest
import torch
from conftest import DIST, relative_diff, run_dist, run_python

import disttrain  # noqa: F401  (installs load_from_checkpoint for disttrain folders)
from common import global_batch, LlamaModule
from disttrain.parallel.checkpoint.io import CheckpointError, model_state, save_sharded
from user_modules import GAN, STEPS, Classifier, probe_tokens, tiny_qwen2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
SHARDED = ["disttrain_fsdp", "disttrain_fsdp_offload", "disttrain_megatron"]  # megatron at tp = pp = 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return run_dist("user_loops.py", tmp_path_factory.mktemp("user_loops"), "ddp", *SHARDED, "disttrain_ddp",
                    timeout=1200)[0]


def part(runs: dict, strategy: str, name: str) -> dict:
    result = runs[strategy][name]
    assert "error" not in result, f"{strategy} {name}: {result['error']}"
    return result


def close(a, b, tol: float) -> bool:
    return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=tol, atol=tol)


# -- manual optimization with two sub-networks -------------------------------------------------------------------
@pytest.mark.parametrize("strategy", SHARDED)
@pytest.mark.parametrize("entry", ["trainer_gan", "fabric_gan", "fabric_pair"])
def test_gan_losses_match_lightning_ddp(runs, strategy, entry):
    got = part(runs, strategy, entry)
    # Fabric's one-container form has no DDP counterpart (DDP syncs only what runs through its forward): the same
    # networks set up one by one under DDP are the reference.
    ref = part(runs, "ddp", "trainer_gan" if entry == "trainer_gan" else "fabric_gan")
    assert len(got["g"]) == len(got["d"]) == STEPS
    assert relative_diff(got["g"], ref["g"]) <= 1e-4, (got["g"], ref["g"])
    assert relative_diff(got["d"], ref["d"]) <= 1e-4, (got["d"], ref["d"])


@pytest.mark.parametrize("strategy", SHARDED)
def test_fabric_container_is_callable_whole_after_its_parts(runs, strategy):
    assert part(runs, strategy, "fabric_pair")["sample_matches"]


# -- the model after fit -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["disttrain_fsdp", "disttrain_ddp"])
def test_model_called_after_fit_equals_export_and_ddp(runs, strategy):
    got, ddp = part(runs, strategy, "classifier"), part(runs, "ddp", "classifier")
    assert relative_diff(got["losses"], ddp["losses"]) <= 1e-4
    assert close(got["full_model"], got["export"], 1e-6)  # the documented way, on rank 0 alone
    assert close(got["full_model"], ddp["called_directly"], 1e-4)
    for way in ("called_directly", "called_through_module", "head_only"):  # every rank calling, or any part
        assert close(got[way], got["full_model"], 1e-6), way


def test_layer_called_outside_its_unit_is_one_line_naming_full_model(runs):
    message = part(runs, "disttrain_fsdp", "classifier")["outside_unit_error"]
    assert "\n" not in message
    assert "Linear 'model.head.fc'" in message and "call 'model' itself on every rank" in message
    assert "with trainer.strategy.full_model():" in message


# -- save_pretrained inside full_model() --------------------------------------------------------------------------
def test_peft_save_pretrained_inside_full_model_reloads_equal_to_ddp(runs):
    """peft's and transformers' ``save_pretrained`` by rank 0 alone inside ``full_model()`` under disttrain_fsdp: the
    state dict holds whole plain tensors, the adapter folder loads into a fresh base with peft's
    ``PeftModel.from_pretrained`` and gives Lightning ddp's logits, and the whole-model folder equals ddp's."""
    from peft import PeftModel
    from safetensors.torch import load_file

    got, ddp = part(runs, "disttrain_fsdp", "peft"), part(runs, "ddp", "peft")
    assert relative_diff(got["losses"], ddp["losses"]) <= 1e-4
    assert got["state_types"] == ["Tensor"] and got["state_shapes"] == ddp["state_shapes"]  # not DTensor shards
    logits = {}
    for name, run in (("fsdp", got), ("ddp", ddp)):
        with torch.no_grad():
            logits[name] = PeftModel.from_pretrained(tiny_qwen2(), run["adapters"])(input_ids=probe_tokens()).logits
    assert close(logits["fsdp"], logits["ddp"], 1e-4)
    assert close(logits["fsdp"], got["logits"], 1e-5)  # what the model computed inside the block, reloaded
    assert close(got["logits_after"], got["logits"], 1e-6)  # the shards are back after it
    whole, reference = (load_file(f"{run['whole']}/model.safetensors") for run in (got, ddp))
    assert whole.keys() == reference.keys() and any(".lora_A." in k for k in whole)
    assert all(close(whole[k], reference[k], 1e-4) for k in whole)


# -- load_from_checkpoint on the folders ModelCheckpoint wrote ---------------------------------------------------
@pytest.fixture(scope="module")
def loaded(runs, tmp_path_factory) -> dict:
    """One fresh plain process loads the Trainer's checkpoint folders with ``MyModule.load_from_checkpoint``."""
    specs = [f"GAN={part(runs, s, 'trainer_gan')['checkpoint']}" for s in ("disttrain_fsdp", "disttrain_megatron")]
    specs.append(f"Classifier={part(runs, 'disttrain_fsdp', 'classifier')['checkpoint']}")
    out = tmp_path_factory.mktemp("loaded") / "loaded.json"
    # run_python: no launcher variables (RANK, WORLD_SIZE, ...), so no process group
    proc = run_python(str(DIST / "load_in_one_process.py"), str(out), *specs, env={"CUDA_VISIBLE_DEVICES": ""},
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("strategy", ["disttrain_fsdp", "disttrain_megatron"])
def test_gan_load_from_checkpoint_folder_reproduces_the_trained_generator(runs, loaded, strategy):
    trained = part(runs, strategy, "trainer_gan")
    result = loaded[trained["checkpoint"]]
    assert result["hparams"] == {"hidden": 24, "lr": 2e-3}  # save_hyperparameters, restored
    assert result["device"] == "cpu" and loaded["distributed"] is False
    assert close(result["out"], trained["probe"], 1e-6)


def test_classifier_load_from_checkpoint_folder(runs, loaded):
    trained = part(runs, "disttrain_fsdp", "classifier")
    result = loaded[trained["checkpoint"]]
    assert result["hparams"] == {"arch": "convnext_atto", "lr": 3e-3}
    assert close(result["out"], trained["full_model"], 1e-6)


@pytest.mark.parametrize("run", ["trainer_ddp", "trainer_zero3"])
def test_llama_load_from_checkpoint_folder_of_other_strategies(request, run):
    """Their step-3 checkpoints (tests/dist/trainer_fsdp.py): the loaded model's loss on step 3's global batch is
    the loss the run logged at step 3."""
    result = request.getfixturevalue(run)[0]
    module = LlamaModule.load_from_checkpoint(os.path.join(result["ckpt_dir"], "epoch=0-step=3.ckpt"))
    ids = global_batch(3, 2)
    with torch.no_grad():
        loss = module.model(input_ids=ids, labels=ids).loss.item()
    assert loss == pytest.approx(result["losses"][3], rel=1e-5)


@pytest.fixture
def gan_folder(runs, tmp_path):
    """A copy of the disttrain_fsdp GAN checkpoint folder to damage."""
    return shutil.copytree(part(runs, "disttrain_fsdp", "trainer_gan")["checkpoint"], tmp_path / "gan.ckpt")


def one_line_error(folder) -> str:
    with pytest.raises(CheckpointError) as info:
        GAN.load_from_checkpoint(folder)
    message = str(info.value)
    assert "\n" not in message and str(folder) in message
    return message


def test_interrupted_save_is_one_line(gan_folder):
    (gan_folder / "meta.pt").unlink()
    assert "is incomplete or not a disttrain checkpoint: missing meta.pt" in one_line_error(gan_folder)


def test_corrupt_shard_is_one_line(gan_folder):
    for shard in gan_folder.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:64])
    assert "is corrupt: its tensors cannot be read" in one_line_error(gan_folder)


def test_corrupt_meta_is_one_line(gan_folder):
    (gan_folder / "meta.pt").write_bytes(b"not a torch file")
    assert "is corrupt: cannot read meta.pt" in one_line_error(gan_folder)


# -- in one process, no launch ------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP saving in this one process
def test_fabric_checkpoint_names_fabric_load_and_export(tmp_path):
    module = GAN()
    folder = save_sharded(tmp_path / "fabric-ckpt", {"model": model_state(module)}, {"step": 3})
    message = one_line_error(folder)
    assert "holds ['model'], no 'state_dict'" in message and "fabric.load" in message and "disttrain export" in message


def test_files_and_other_folders_still_go_to_lightning(tmp_path):
    module = GAN(hidden=16)
    torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": L.__version__,
                "hyper_parameters": dict(module.hparams)}, tmp_path / "plain.ckpt")  # a single-file checkpoint
    assert GAN.load_from_checkpoint(tmp_path / "plain.ckpt").hparams.hidden == 16
    (tmp_path / "not-a-checkpoint").mkdir()
    lightning_fsdp = tmp_path / "lightning-fsdp"  # Lightning's own sharded layout: meta.pt without our format entry
    lightning_fsdp.mkdir()
    torch.save({"pytorch-lightning_version": L.__version__}, lightning_fsdp / "meta.pt")
    (lightning_fsdp / ".metadata").write_bytes(b"")
    for folder in ("not-a-checkpoint", "lightning-fsdp"):
        with pytest.raises(IsADirectoryError):
            GAN.load_from_checkpoint(tmp_path / folder)
