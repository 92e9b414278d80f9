"""One checkpoint layout for every strategy: moves between strategies and world sizes, crashes while saving,
elastic restarts after a killed rank, exports (CPU, gloo, fp32)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, child_env, free_port, run_dist, run_python

from common import reference_losses, tiny_llama
from disttrain.parallel.checkpoint.io import CheckpointError, latest_checkpoint, load_sharded

TOL = 1e-5


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= TOL for x, y in zip(a, b))


@pytest.mark.slow
def test_checkpoint_moves_across_strategies_and_world_sizes(tmp_path):
    """zero3@2 -> fsdp@4 -> megatron tp=2 -> megatron pp=2 -> ddp@1 -> megatron cp=2 -> zero3@2, one step each after
    a resume (two before the first save and two at the end, so restored optimizer state shows): every step's loss
    equals the uninterrupted one-process run. Context parallelism (each sequence split over two ranks, Fabric) trains
    the same steps, and its checkpoints are the same as any other strategy's."""
    reference = reference_losses(9, world_size=2)  # global_batch(step, 2): the same 4 samples per step everywhere
    chain = [("disttrain_zero3", 2, "-", 2), ("disttrain_fsdp", 4, "zero3", 1),
             ("disttrain_megatron:tensor_parallel_size=2", 2, "fsdp", 1),
             ("disttrain_megatron:pipeline_parallel_size=2", 2, "tp2", 1), ("disttrain_ddp", 1, "pp2", 1),
             ("disttrain_megatron:context_parallel_size=2", 2, "ddp", 1), ("disttrain_zero3", 2, "cp2", 2)]
    names = ["zero3", "fsdp", "tp2", "pp2", "ddp", "cp2", "zero3b"]
    losses, starts = [], []
    for (spec, nproc, load, steps), name in zip(chain, names):
        load_arg = "-" if load == "-" else str(tmp_path / f"ckpt-{load}")
        (tmp_path / name).mkdir()
        ranks = run_dist("moves.py", tmp_path / name, spec, load_arg, str(steps), str(tmp_path / f"ckpt-{name}"),
                         nproc=nproc)
        starts.append(ranks[0]["start"])
        losses += ranks[0]["losses"]
    assert starts == [0, 2, 3, 4, 5, 6, 7]
    assert close(losses, reference), (losses, reference)


@pytest.mark.slow
def test_vit_checkpoint_keeps_timm_qkv_order_across_tensor_parallel_sizes(tmp_path):
    """A timm ViT's fused qkv rows are rank-major under TP; checkpoints store timm's order, so megatron tp=2 ->
    fsdp -> megatron tp=2 continues exactly."""
    from common import vit_reference_losses

    losses = []
    for name, spec, load, save in (("tp2", "disttrain_megatron:tensor_parallel_size=2", "-", "a"),
                                   ("fsdp", "disttrain_fsdp", "a", "b"),
                                   ("tp2b", "disttrain_megatron:tensor_parallel_size=2", "b", "-")):
        args = [spec, "-" if load == "-" else str(tmp_path / load), "1", "-" if save == "-" else str(tmp_path / save)]
        (tmp_path / name).mkdir()
        losses += run_dist("moves.py", tmp_path / name, *args, "vit")[0]["losses"]
    assert close(losses, vit_reference_losses(3)), losses


@pytest.mark.slow
def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path):
    ckpts = tmp_path / "ckpts"
    proc = run_python(str(ROOT / "tests/dist/crash_save.py"), str(tmp_path / "out"), str(ckpts), timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]  # killed inside the second save
    assert sorted(p.name for p in ckpts.iterdir()) == [".step-000002.tmp", "step-000001"]
    assert latest_checkpoint(ckpts) == ckpts / "step-000001"
    model = tiny_llama(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert load_sharded(ckpts / "step-000001", {"model": model, "optimizer": opt}, model) == {"step": 1}
    assert opt.state_dict()["state"][0]["step"].item() == 1
    with pytest.raises(CheckpointError, match=r"step-000002.tmp' is incomplete .*missing meta.pt \(was the save"
                                              r" interrupted\?\)"):
        load_sharded(ckpts / ".step-000002.tmp", {"model": model}, model)


@pytest.mark.slow
def test_killed_rank_restarts_and_resumes_from_the_last_checkpoint(tmp_path):
    """`disttrain run --max-restarts 1`: rank 1 is SIGKILLed after step 2 on the first attempt; the job finishes
    and the steps after the resume equal the uninterrupted run."""
    out, ckpts = tmp_path / "elastic", tmp_path / "ckpts"
    cmd = [sys.executable, "-m", "disttrain.cli", "run", "tests/dist/elastic_resume.py", "--accelerator", "cpu",
           "--devices", "2", "--strategy", "disttrain_fsdp", "--max-restarts", "1", "--main-port", str(free_port()),
           str(out), str(ckpts), "4", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The first attempt really lost a rank (rank 1 killed itself; which failure torchrun logs first, rank 1's SIGKILL
    # or rank 0's broken connection to it, is a race), and both ranks of the second attempt resumed from step 2.
    assert Path(f"{out}.killed").exists()
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    assert [(r["attempt"], r["start"]) for r in ranks] == [(1, 2), (1, 2)]
    assert close(ranks[0]["losses"], reference_losses(4, world_size=2)[2:])
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-00000{i}" for i in range(1, 5)]


def test_hybrid_shard_sizes_are_checked():
    from disttrain.parallel.mesh import ParallelDims

    with pytest.raises(ValueError, match=r"world_size=4 is not divisible by dp_replicate=3; choose sizes whose"
                                         r" product divides 4"):
        ParallelDims(world_size=4, dp_replicate=3)
    assert ParallelDims(world_size=8, dp_replicate=2).dp_shard == 4


# -- exports from a checkpoint (one process) -------------------------------------------------------------------
def _save(path: Path, model: torch.nn.Module, **metadata) -> Path:
    from disttrain.parallel.checkpoint.io import model_state, optimizer_state, save_sharded

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return save_sharded(path, {"model": model_state(model), "optimizer": optimizer_state(model, opt)}, metadata)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow
def test_export_hf_directory_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_llama(seed=3)
    ckpt = _save(tmp_path / "ckpt", model, hf_config=model.config.to_dict())
    out = tmp_path / "hf"
    proc = run_python("-m", "disttrain.cli", "export", str(ckpt), "--to", "hf", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert _same(loaded, model)
    ids = torch.arange(8).unsqueeze(0)
    # same weights; the loaded model may pick another attention kernel (sdpa vs eager): equal up to rounding
    assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_export_hf_needs_a_config(tmp_path):
    from disttrain.parallel.checkpoint.export import export_checkpoint

    model = tiny_llama(seed=3)
    ckpt = _save(tmp_path / "ckpt", model)
    with pytest.raises(CheckpointError, match=r"holds no 'hf_config'; pass --config CONFIG.json"):
        export_checkpoint(ckpt, "hf", tmp_path / "hf")
    model.config.save_pretrained(tmp_path / "cfg")  # or the config given explicitly
    from transformers import AutoModelForCausalLM

    assert _same(AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, "hf", tmp_path / "hf",
                                                                        config=tmp_path / "cfg")), model)


def test_export_timm_state_dict_loads_in_timm(tmp_path):
    import timm
    from timm.models import load_checkpoint

    from disttrain.parallel.checkpoint.export import export_checkpoint

    def vit():
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=64,
                                 depth=2, num_heads=4, num_classes=10)

    torch.manual_seed(0)
    model = vit()
    ckpt = _save(tmp_path / "ckpt", model)
    for name in ("vit.safetensors", "vit.pth"):
        out = export_checkpoint(ckpt, "timm", tmp_path / name)
        torch.manual_seed(1)
        fresh = vit()
        load_checkpoint(fresh, str(out))
        assert _same(fresh, model)


def test_export_torch_state_dict_loads_in_a_plain_module(tmp_path):
    from disttrain.parallel.checkpoint.export import export_checkpoint

    def net():
        return torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Flatten(), torch.nn.Linear(24, 1))

    torch.manual_seed(0)
    model = net()
    out = export_checkpoint(_save(tmp_path / "ckpt", model), "torch", tmp_path / "deepfm.pt")
    fresh = net()
    fresh.load_state_dict(torch.load(out, weights_only=True))
    assert _same(fresh, model)


def test_deploy_files_parse_and_name_the_llm_recipe():
    import yaml

    job = yaml.safe_load((ROOT / "deploy/kubernetes/dialogue-llm-pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob" and job["spec"]["elasticPolicy"]["maxRestarts"] >= 1
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "recipes/nlp/dialogue_llm.py"
    sbatch = ROOT / "deploy/slurm/dialogue_llm.sbatch"
    assert subprocess.run(["bash", "-n", str(sbatch)]).returncode == 0
    assert "--max-restarts" in sbatch.read_text() and "recipes/nlp/dialogue_llm.py" in sbatch.read_text()


def test_latest_checkpoint_skips_leftovers_and_incomplete_folders(tmp_path):
    from disttrain.parallel.checkpoint.io import model_state, save_sharded

    assert latest_checkpoint(tmp_path / "none") is None
    model = torch.nn.Linear(2, 2)
    for step in (1, 2, 10):
        save_sharded(tmp_path / f"step-{step:06d}", {"model": model_state(model)}, {"step": step})
    (tmp_path / ".step-000011.tmp").mkdir()         # an interrupted save
    (tmp_path / "step-000012").mkdir()              # a folder without meta.pt (copied by hand, say)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000010"
