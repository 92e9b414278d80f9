"""The ViT trainer: configs (the 2B count on the meta device), digits data, the loss contract, the timm export,
the strategy/config defaults, and multi-process runs through Fabric and the Trainer compared with one process."""

from __future__ import annotations

import collections
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from conftest import ROOT, free_port, launch, run_launched, run_python
from safetensors.torch import load_file

from disttrain.vision import (ImageFolderData, SkippingSampler, TrainConfig, ViTClassifier, build_vit, count_parameters,
                              data_config, default_config, default_strategy, export_timm, read_yaml, write_digits)
from disttrain.vision.config import TIMM_ARCHITECTURE, train_config
from disttrain.vision.data import stratified_split
from disttrain.vision.defaults import reference_options
from disttrain.vision.export import PREFIX
from vision_fabric import MODEL, batch, classifier, reference

CONFIGS = ROOT / "configs" / "vision"


def test_vit2b_has_2b_parameters_counted_on_meta():
    args = read_yaml(CONFIGS / "vit2b.yaml")["model"]
    model = build_vit(args, device="meta")
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    n = count_parameters(args)
    assert abs(n - 2.0e9) <= 0.05 * 2.0e9, n
    assert args["embed_dim"] // args["num_heads"] % 8 == 0  # FlashAttention-2 head size
    assert args["num_heads"] % 2 == 0  # head-split tp=2


def test_configs_are_fully_commented_and_well_formed():
    for path in CONFIGS.glob("*.yaml"):
        config = read_yaml(path)
        train_config(config["train"])
        data_config(config["data"])
        for line in path.read_text().splitlines():
            if line.startswith("  ") and ":" in line and not line.strip().startswith("#"):
                assert "#" in line, f"{path.name}: uncommented key {line!r}"


def test_bad_config_values_name_the_fix():
    with pytest.raises(ValueError, match=r"\['embed_dims'\] are not VisionTransformer arguments"):
        build_vit({"embed_dims": 64}, device="meta")
    with pytest.raises(ValueError, match="embed_dim=66 is not divisible by num_heads=4"):
        build_vit({"embed_dim": 66, "num_heads": 4}, device="meta")
    with pytest.raises(TypeError, match="did you mean 'epochs'"):
        train_config({"epoch": 3})
    with pytest.raises(ValueError, match="batch_size=15 is odd"):
        data_config({"batch_size": 15, "mixup": 0.8})
    with pytest.raises(FileNotFoundError, match="vit_tiny.yaml"):
        read_yaml(CONFIGS / "nope.yaml")


def test_digits_tree_is_deterministic_and_atomic(tmp_path):
    a, b = write_digits(tmp_path / "a"), write_digits(tmp_path / "b")
    files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*.png"))
    assert files == sorted(p.relative_to(b).as_posix() for p in b.rglob("*.png"))
    assert len([f for f in files if f.startswith("train/")]) == 1437 and len(files) == 1797  # 360 in val
    per_class = collections.Counter(f.split("/")[1] for f in files)  # stratified: each digit's share of the 360
    val = collections.Counter(f.split("/")[1] for f in files if f.startswith("val/"))
    assert all(abs(val[d] - n * 360 / 1797) < 1 for d, n in per_class.items()), val
    assert not list(tmp_path.glob(".*tmp"))  # the temporary tree was renamed into place
    assert write_digits(a) == a  # a complete tree is kept
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a complete digits tree"):
        write_digits(tmp_path / "other")


def test_stratified_split_is_seeded_and_refuses_fractions_outside_0_1():
    labels = np.repeat(np.arange(3), [10, 20, 30])
    train, val = stratified_split(labels, 0.2, seed=0)
    assert sorted([*train, *val]) == list(range(60)) and np.bincount(labels[val]).tolist() == [2, 4, 6]
    uneven = np.repeat(np.arange(3), [1, 1, 5])  # ceil(3.5) = 4 in val; the largest remainders get the rounding
    assert np.bincount(uneven[stratified_split(uneven, 0.5, seed=0)[1]], minlength=3).tolist() == [1, 0, 3]
    assert (stratified_split(labels, 0.2, seed=0)[1] == val).all()
    assert not (stratified_split(labels, 0.2, seed=1)[1] == val).all()
    with pytest.raises(ValueError, match="val_fraction=1.5 must lie between 0 and 1"):
        stratified_split(labels, 1.5, seed=0)


def test_data_module_checks_class_folders(tmp_path):
    root = write_digits(tmp_path / "digits")
    data = ImageFolderData(data_config({"root": str(root)}), img_size=32, num_classes=10)
    data.prepare_data()
    data.setup()
    images, target = next(iter(data.val_dataloader()))
    assert images.shape == (32, 3, 32, 32) and target.dtype == torch.int64
    with pytest.raises(ValueError, match="has 10 class folders but model.num_classes is 7"):
        ImageFolderData(data_config({"root": str(root)}), img_size=32, num_classes=7).setup()
    with pytest.raises(FileNotFoundError, match="has no train/ or val/ folder"):
        ImageFolderData(data_config({"root": str(tmp_path / "none")}), img_size=32, num_classes=10).prepare_data()


def test_training_step_is_loss_fn_of_model_output():
    """The pipeline-parallel contract: training_step == loss_fn(model(images), target); soft targets (mixup)
    use soft-target cross-entropy."""
    vit = classifier()
    images, target = batch(0)
    assert vit.training_step((images, target), 0).item() == vit.loss_fn(vit.model(images), target).item()
    logits = vit.model(images)
    one_hot = F.one_hot(target, MODEL["num_classes"]).float()
    assert vit.loss_fn(logits, one_hot).item() == pytest.approx(F.cross_entropy(logits, target).item(), rel=1e-6)
    mixed = ViTClassifier(MODEL, data=data_config({"mixup": 0.8, "batch_size": 8}))
    mixed.configure_model()
    assert torch.isfinite(mixed.training_step((images, target), 0))


def test_activation_checkpointing_and_sdpa_follow_the_config():
    vit = ViTClassifier(MODEL, TrainConfig(activation_checkpointing=True, sdpa=True))
    vit.configure_model()
    assert vit.model.grad_checkpointing and all(b.attn.fused_attn for b in vit.model.blocks)
    eager = ViTClassifier(MODEL, TrainConfig(sdpa=False))
    eager.configure_model()
    eager.model.load_state_dict(vit.model.state_dict())
    images = batch(0)[0]
    torch.testing.assert_close(vit.model(images), eager.model(images), rtol=1e-5, atol=1e-5)


def test_export_loads_in_timm(tmp_path):
    from disttrain.parallel.checkpoint.io import export_safetensors

    vit = classifier()
    out = export_timm(tmp_path / "export", MODEL, lambda p: export_safetensors(vit, p, prefix=PREFIX),
                      data=data_config({}), class_names=[f"c{i}" for i in range(5)])
    images = batch(3)[0]
    vit.eval()
    by_name = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    by_hand = timm.create_model(TIMM_ARCHITECTURE, **MODEL).eval()
    by_hand.load_state_dict(load_file(out / "model.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(by_name(images), vit(images))
        torch.testing.assert_close(by_hand(images), vit(images))
    assert json.loads((out / "config.json").read_text())["label_names"] == [f"c{i}" for i in range(5)]
    assert not list(tmp_path.glob(".*tmp"))


def test_timm_config_is_the_same_with_older_save_config_for_hf(tmp_path, monkeypatch):
    """timm releases before ``save_config_for_hf(..., data_config=)`` (and before ``model_args=``): the call is made
    with the arguments the installed signature takes, and config.json comes out the same."""
    import timm.models._hub as hub

    from disttrain.vision.export import write_timm_config

    current = hub.save_config_for_hf

    def without_data_config(model, config_path, model_config=None, model_args=None):
        return current(model, config_path, model_config=model_config, model_args=model_args)

    def without_model_args(model, config_path, model_config=None):
        return current(model, config_path, model_config=model_config)

    written = []
    for i, writer in enumerate((current, without_data_config, without_model_args)):
        monkeypatch.setattr(hub, "save_config_for_hf", writer)
        write_timm_config(tmp_path / f"{i}.json", MODEL, data_config({}), ["a", "b"])
        written.append(json.loads((tmp_path / f"{i}.json").read_text()))
    assert written[0]["pretrained_cfg"]["crop_pct"] == 1.0 and written[0]["model_args"]
    assert written[1] == written[0] and written[2] == written[0]


def test_default_strategy_and_config(monkeypatch):
    from disttrain.parallel import registry

    assert default_strategy(2, "cpu") == ("disttrain_fsdp", {})
    assert default_config(2, None).name == "vit_tiny.yaml"  # CPU: the tiny config
    assert default_config(16, 80 * 2**30).name == "vit2b.yaml"  # 16 x 80 GiB: the 2B model fits
    # one 16 GiB device under disttrain_fsdp (no offload): the planner says 32 GB of state does not fit
    assert default_config(1, 16 * 2**30).name == "vit_tiny.yaml"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_strategy(16, "gpu") == ("disttrain_megatron", {"tensor_parallel_size": 2})
    assert default_strategy(1, "gpu") == ("disttrain_fsdp", {})  # tp=2 needs two devices
    assert default_strategy(3, "gpu") == ("disttrain_fsdp", {})  # ... and an even number of them
    assert default_strategy(2, "cpu") == ("disttrain_fsdp", {})
    # The reference set-up is asked of the registry (the strategy that takes tensor_parallel_size), not named.
    without = tuple(row for row in registry.STRATEGIES if row.name != "disttrain_megatron")
    monkeypatch.setattr(registry, "STRATEGIES", without)
    assert default_strategy(2, "gpu") == ("disttrain_fsdp", {})


def test_reference_tp_applies_where_the_strategy_takes_it_and_no_size_is_given():
    assert reference_options("disttrain_megatron", {}, 2) == {"tensor_parallel_size": 2}
    assert reference_options("disttrain_megatron", {"pipeline_parallel_size": 2}, 2) == {}  # the user's sizes
    assert reference_options("disttrain_megatron", {"tensor_parallel_size": 1}, 2) == {}
    assert reference_options("disttrain_megatron", {}, 1) == {}  # tp=2 does not divide 1 process
    assert reference_options("disttrain_fsdp", {}, 2) == {} and reference_options("ddp", {}, 2) == {}


def test_a_resumed_epoch_skips_the_samples_trained_before_its_checkpoint():
    data = list(range(40))
    whole = SkippingSampler(data, num_replicas=2, rank=1, shuffle=True, seed=0)
    resumed = SkippingSampler(data, num_replicas=2, rank=1, shuffle=True, seed=0)
    for sampler in (whole, resumed):
        sampler.set_epoch(3)
    resumed.skip = 6
    assert list(resumed) == list(whole)[6:]
    assert list(resumed) == list(whole)  # the epoch after starts at its beginning again


@pytest.fixture(scope="module")
def single_process() -> dict:
    return reference()


@pytest.mark.slow
@pytest.mark.parametrize("spec,ac", [("disttrain_fsdp", "1"), ("disttrain_ddp", "0")])
def test_fabric_run_matches_one_process_and_resumes(tmp_path_factory, single_process, spec, ac):
    ranks = launch(tmp_path_factory, "vision_fabric.py", spec, ac)
    result = ranks[0]
    assert result["grad_checkpointing"] == (ac == "1")
    assert result["losses"] == pytest.approx(single_process["losses"], rel=1e-5)
    assert result["val_acc"] == pytest.approx(single_process["val_acc"], abs=1e-6)
    assert result["val_loss"] == pytest.approx(single_process["val_loss"], rel=1e-5)
    assert result["resumed_step"] == 3 and result["lr_after"] == pytest.approx(result["lr_before"])
    assert result["resumed_losses"] == pytest.approx(result["losses"][3:], rel=1e-6)
    assert "head.weight" in result["export_keys"] and "blocks.1.mlp.fc2.weight" in result["export_keys"]


@pytest.mark.slow
def test_trainer_fsdp_matches_one_process(tmp_path_factory, single_process):
    result = launch(tmp_path_factory, "vision_trainer.py", "disttrain_fsdp")[0]
    assert result["strategy"] == "FSDPStrategy"
    assert result["losses"] == pytest.approx(single_process["losses"], rel=1e-5)
    assert result["val_acc"] == pytest.approx(single_process["val_acc"], abs=1e-6)
    assert result["val_loss"] == pytest.approx(single_process["val_loss"], rel=1e-5)
    assert ".metadata" in result["checkpoint_files"]  # a sharded, resumable folder
    model = timm.create_model(f"local-dir:{result['export']}", pretrained=True)
    assert model.num_classes == MODEL["num_classes"]


def run_recipe(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """`lightning run model recipes/vision/vit2b.py --accelerator cpu --devices 2 ARGS` (ARGS may hold --strategy)."""
    args = list(args)
    strategy = args.pop(args.index("--strategy") + 1) if "--strategy" in args else None
    if strategy is not None:
        args.remove("--strategy")
    start = time.perf_counter()
    proc = run_launched("recipes/vision/vit2b.py", *args, strategy=strategy, timeout=900)
    return proc, time.perf_counter() - start


def final_accuracy(stdout: str) -> float:
    return float(stdout.split("final val_acc ")[1].split(";")[0])


def accuracy_of_export(export: Path, data_root: Path) -> float:
    model = timm.create_model(f"local-dir:{export}", pretrained=True).eval()
    data = ImageFolderData(data_config({"root": str(data_root)}), img_size=32, num_classes=10)
    data.setup()
    correct = total = 0
    with torch.no_grad():
        for images, target in data.val_dataloader():
            correct += (model(images).argmax(-1) == target).sum().item()
            total += len(target)
    return correct / total


@pytest.mark.slow
def test_recipe_learns_digits_under_fsdp_and_resumes(tmp_path):
    """The README command on 2 CPU processes: the default (tiny) config passes 80% validation accuracy on the
    digits within 3 minutes; the export is a timm model just as accurate; a resumed run continues."""
    out, digits = tmp_path / "run", tmp_path / "digits"
    proc, seconds = run_recipe("--strategy", "disttrain_fsdp", "--out", str(out), "--data-root", str(digits))
    assert proc.returncode == 0, proc.stderr[-4000:]
    accuracy = final_accuracy(proc.stdout)
    print(f"\nvit_tiny, disttrain_fsdp, 2 CPU processes: val_acc {accuracy:.4f} in {seconds:.0f} s wall")
    assert "vit_tiny.yaml" in proc.stdout and "FSDPStrategy on 2 x cpu" in proc.stdout
    assert accuracy > 0.8
    assert accuracy_of_export(out / "export", digits) == pytest.approx(accuracy, abs=0.01)

    proc, _ = run_recipe("--strategy", "disttrain_fsdp", "--out", str(tmp_path / "more"), "--data-root", str(digits),
                         "--resume", str(out / "ckpt"), "--epochs", "9")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout and "at epoch 8, step 352" in proc.stdout
    assert "epoch 9 step 360" in proc.stdout and "epoch 1 " not in proc.stdout  # only the new epoch ran
    assert final_accuracy(proc.stdout) > 0.8


@pytest.mark.slow
def test_recipe_on_one_device_with_lightnings_own_strategy_trains(tmp_path):
    """`--devices 1 --strategy auto` is Lightning's single-device strategy, which leaves an empty_init model as
    uninitialised memory: the recipe builds normally there (the loss was NaN from the first step)."""
    proc = run_python("recipes/vision/vit2b.py", "--config", "configs/vision/vit_tiny.yaml", "--devices", "1",
                      "--strategy", "auto", "--max-steps", "3", "--out", str(tmp_path / "run"), "--data-root",
                      str(tmp_path / "digits"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "SingleDeviceStrategy on 1 x cpu" in proc.stdout
    losses = [float(line.split("loss ")[1].split()[0]) for line in proc.stdout.splitlines() if "  loss " in line]
    assert len(losses) == 3 and all(2.0 < loss < 2.5 for loss in losses), losses  # ln(10) = 2.30 at the start


@pytest.mark.slow
def test_recipe_runs_under_zero3_offload(tmp_path):
    out, digits = tmp_path / "run", tmp_path / "digits"
    proc, _ = run_recipe("--strategy", "disttrain_zero3_offload", "--config", "configs/vision/vit_tiny.yaml",
                         "--out", str(out), "--data-root", str(digits), "--max-steps", "6")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ZeroStrategy on 2 x cpu" in proc.stdout and (out / "ckpt" / ".metadata").is_file()  # the DCP layout
    assert accuracy_of_export(out / "export", digits) == pytest.approx(final_accuracy(proc.stdout), abs=0.01)


@pytest.mark.slow
def test_recipe_runs_under_megatron_with_head_split_tp(tmp_path):
    """The source document's 2B set-up on CPU: `--strategy disttrain_megatron` gives tensor_parallel_size=2; the
    export (fused qkv rows back in timm's order) scores in timm what the run reported."""
    out, digits = tmp_path / "run", tmp_path / "digits"
    proc, _ = run_recipe("--strategy", "disttrain_megatron", "--config", "configs/vision/vit_tiny.yaml",
                         "--out", str(out), "--data-root", str(digits), "--max-steps", "135")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "MegatronStrategy on 2 x cpu" in proc.stdout and (out / "ckpt" / ".metadata").is_file()
    accuracy = final_accuracy(proc.stdout)
    assert accuracy > 0.2  # learning (10 classes: chance is 0.1), after 1.5 epochs
    # TP sums in another order than one process: a few near-tie predictions may flip
    assert accuracy_of_export(out / "export", digits) == pytest.approx(accuracy, abs=0.02)


@pytest.mark.slow
def test_recipe_runs_pipeline_stages_from_the_shared_flags_and_resumes_inside_an_epoch(tmp_path):
    """`python recipes/vision/vit2b.py --strategy disttrain_megatron --pipeline-parallel-size 2` (the recipe starts
    its 2 CPU processes): two stages and no default head split (a size was given); --save-every writes a checkpoint
    every 2 steps, and a run resumed from the first one continues inside the epoch, with the steps left."""
    out, digits = tmp_path / "run", tmp_path / "digits"
    common = ("recipes/vision/vit2b.py", "--config", "configs/vision/vit_tiny.yaml", "--strategy", "disttrain_megatron",
              "--pipeline-parallel-size", "2", "--steps", "4", "--log-every", "1", "--data-root", str(digits),
              "--no-report")
    proc = run_python(*common, "--save-every", "2", "--out", str(out), env={"MASTER_PORT": str(free_port())},
                      timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    strategy = json.loads((out / "run.json").read_text())["strategy"]
    assert strategy["options"] == {"pipeline_parallel_size": 2} and strategy["degrees"] == {"dp_shard": 1, "pp": 2}
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    resumed = run_python(*common, "--resume", str(out / "checkpoints" / "step-000002"), "--out", str(tmp_path / "b"),
                         env={"MASTER_PORT": str(free_port())}, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-4000:]
    assert "at epoch 0, step 2" in resumed.stdout
    assert "epoch 1 step 3:" in resumed.stdout and "epoch 1 step 1:" not in resumed.stdout
    assert (tmp_path / "b" / "export" / "model.safetensors").is_file()


@pytest.mark.slow
def test_recipe_accumulates_to_the_global_batch_under_the_old_flag_names(tmp_path):
    """--global-batch on one process: 64 images per optimizer step are 2 micro-steps of --batch-size 32 (the old
    name of --micro-batch), and --max-steps (the old --steps) still stops the run."""
    proc = run_python("recipes/vision/vit2b.py", "--config", "configs/vision/vit_tiny.yaml", "--devices", "1",
                      "--strategy", "auto", "--batch-size", "32", "--global-batch", "64", "--max-steps", "3",
                      "--log-every", "1", "--out", str(tmp_path / "run"), "--data-root", str(tmp_path / "digits"),
                      "--no-report", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "2 micro-step(s) of 32 images per optimizer step" in proc.stdout
    assert "epoch 1 step 3:" in proc.stdout and "step 4" not in proc.stdout
