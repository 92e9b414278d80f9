"""Checkpoint files: atomic writes, clear errors for missing/incomplete/corrupt checkpoints, consolidation."""

from pathlib import Path

import pytest
import torch
from conftest import run_python
from safetensors.torch import load_file

from common import tiny_llama
from disttrain.parallel.checkpoint.io import (
    CheckpointError,
    check_checkpoint,
    consolidate,
    load_sharded,
    model_state,
    optimizer_state,
    save_sharded,
)
from disttrain.parallel.engines.fsdp import FSDPEngine
from disttrain.parallel.split.fsdp import FSDPOptions


@pytest.fixture
def trained():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 96, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return model, opt


def save(path, model, opt, step=1):
    return save_sharded(path, {"model": model_state(model), "optimizer": optimizer_state(model, opt)},
                        {"step": step})


def test_roundtrip_and_atomic_overwrite(tmp_path, trained):
    model, opt = trained
    path = tmp_path / "ckpt"
    save(path, model, opt, step=1)
    save(path, model, opt, step=2)  # overwrite in place: the old folder is swapped out, never half-written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    fresh = tiny_llama(seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    meta = load_sharded(path, {"model": fresh, "optimizer": fresh_opt}, fresh)
    assert meta == {"step": 2}
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], fresh_opt.state_dict()["state"][0]["exp_avg"])


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"checkpoint '.*nope' does not exist; pass the folder"):
        check_checkpoint(tmp_path / "nope")


def test_incomplete_folder(tmp_path, trained):
    path = save(tmp_path / "ckpt", *trained)
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete or not a disttrain checkpoint: missing \.metadata"):
        load_sharded(path, {"model": trained[0]}, trained[0])


def test_corrupt_metadata_file(tmp_path, trained):
    path = save(tmp_path / "ckpt", *trained)
    (path / "meta.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=r"is corrupt: cannot read meta.pt"):
        load_sharded(path, {"model": trained[0]}, trained[0])


def test_corrupt_shard(tmp_path, trained):
    path = save(tmp_path / "ckpt", *trained)
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 10])  # an interrupted copy
    with pytest.raises(CheckpointError, match=rf"is corrupt: cannot read {shard.name} \(it has \d+ bytes, manifest"
                                              r"\.json says \d+: truncated or overwritten\); resume from an earlier"):
        load_sharded(path, {"model": trained[0]}, trained[0])


def test_wrong_state_keys(tmp_path, trained):
    path = save(tmp_path / "ckpt", *trained)
    with pytest.raises(CheckpointError, match=r"has no \['net'\] \(it holds \['model', 'optimizer'\]\)"):
        load_sharded(path, {"net": trained[0]}, trained[0])


def test_engine_reports_missing_path(tmp_path, trained):
    engine = FSDPEngine(FSDPOptions())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        engine.load_checkpoint(tmp_path / "missing", trained[0], {"model": trained[0]})


def test_consolidate_to_safetensors(tmp_path, trained):
    model, opt = trained
    path = save(tmp_path / "ckpt", model, opt)
    out = consolidate(path, tmp_path / "full.safetensors")
    plain = tiny_llama(seed=3)
    plain.load_state_dict(load_file(out))
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_export_command(tmp_path, trained):
    path = save(tmp_path / "ckpt", *trained)
    out = tmp_path / "cli.safetensors"
    proc = run_python("-m", "disttrain.cli", "export", str(path), str(out), "--key", "model")
    assert proc.returncode == 0, proc.stderr
    assert set(load_file(out)) == set(trained[0].state_dict())


@pytest.mark.slow
def test_export_command_reports_missing_checkpoint(tmp_path):
    proc = run_python("-m", "disttrain.cli", "export", str(tmp_path / "none"), str(tmp_path / "o.safetensors"))
    assert proc.returncode != 0 and "does not exist" in proc.stderr
    assert not Path(tmp_path / "o.safetensors").exists()


def test_unsafe_metadata_is_refused_with_the_fix(tmp_path, trained):
    model, opt = trained
    path = save_sharded(tmp_path / "ckpt", {"model": model_state(model)}, {"hyper_parameters": {"root": Path("/x")}})
    with pytest.raises(CheckpointError, match=r"safe loading refuses.*weights_only=False"):
        load_sharded(path, {"model": model}, model)
    assert load_sharded(path, {"model": model}, model, weights_only=False)["hyper_parameters"]["root"] == Path("/x")


def test_bad_export_prefix_names_the_fix(tmp_path, trained):
    from disttrain.parallel.checkpoint.io import export_safetensors

    with pytest.raises(ValueError, match=r"prefix='net\.' matches no parameter \(keys start like 'model\.embed"
                                         r"_tokens\.weight'\); pass the submodule's attribute path"):
        export_safetensors(trained[0], tmp_path / "x.safetensors", prefix="net.")
    assert not (tmp_path / "x.safetensors").exists()
