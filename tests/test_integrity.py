"""Checkpoint integrity: content checksums verified at every load and by `disttrain verify`, a restricted unpickler
for DCP's metadata and non-tensor items, and recovery of a save killed between its two renames (one process)."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import xxhash

from conftest import ROOT, run_python
from disttrain.parallel.checkpoint.io import (
    CheckpointError,
    latest_checkpoint,
    load_sharded,
    model_state,
    optimizer_state,
    read_full,
    save_sharded,
)
from disttrain.parallel.checkpoint.integrity import (
    MANIFEST_FILE,
    UnverifiedCheckpointWarning,
    load_metadata,
    verify_checkpoint,
)


def net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    return model, opt


def save(path: Path, model, opt, step: int = 1) -> Path:
    return save_sharded(path, {"model": model_state(model), "optimizer": optimizer_state(model, opt)},
                        {"step": step})


def load(path: Path) -> tuple[torch.nn.Module, dict]:
    model = net(seed=9)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, load_sharded(path, {"model": model, "optimizer": opt}, model)


def cli(*args: str) -> subprocess.CompletedProcess:
    return run_python("-m", "disttrain.cli", *args, timeout=300)


def tensor_bytes_at(path: Path, tensor: torch.Tensor) -> tuple[Path, int]:
    """The shard file holding ``tensor``'s raw bytes and where they start in it."""
    raw = tensor.detach().contiguous().numpy().tobytes()
    for shard in sorted(path.glob("*.distcp")):
        at = shard.read_bytes().find(raw)
        if at >= 0:
            return shard, at
    raise AssertionError("tensor bytes not found in any shard")


@pytest.fixture
def checkpoint(tmp_path):
    model, opt = trained()
    return save(tmp_path / "ckpt", model, opt), model


def assert_one_line_naming(error: str, name: str) -> None:
    assert "\n" not in error and f"cannot read {name}" in error and "resume from an earlier checkpoint" in error, error


@pytest.mark.slow
def test_save_writes_a_manifest_and_an_untouched_checkpoint_verifies(checkpoint):
    path, model = checkpoint
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "meta.pt"] and manifest["hash"] == "xxh3_128"
    shard = path / "__0_0.distcp"
    assert manifest["files"][shard.name] == {"bytes": shard.stat().st_size,
                                             "xxh3_128": [xxhash.xxh3_128(shard.read_bytes()).hexdigest()]}
    assert verify_checkpoint(path) == path
    proc = cli("verify", str(path))
    assert proc.returncode == 0 and proc.stdout.startswith(f"{path}: ok (3 files"), proc.stdout + proc.stderr
    loaded, meta = load(path)
    assert meta == {"step": 1} and all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))


@pytest.mark.slow
def test_a_sha256_manifest_of_the_first_version_still_verifies(checkpoint):
    """The first manifests used sha256: the manifest names its hash, so they verify, and damage is still found."""
    path, _ = checkpoint
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["hash"] = "sha256"
    manifest["files"] = {name: {"bytes": (path / name).stat().st_size,
                                "sha256": [hashlib.sha256((path / name).read_bytes()).hexdigest()]}
                         for name in manifest["files"]}
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert verify_checkpoint(path) == path
    load(path)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="do not match their sha256"):
        verify_checkpoint(path)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped bytes", "nan rows"])
def test_damaged_tensor_fails_every_load_path_and_verify_naming_the_file(checkpoint, tmp_path, damage):
    path, model = checkpoint
    weight = model[0].weight
    shard, at = tensor_bytes_at(path, weight)
    data = bytearray(shard.read_bytes())
    if damage == "flipped bytes":
        data[at + 100] ^= 0xFF
        data[at + 101] ^= 0x01
    else:  # two rows of NaN where the first rows of the weight were
        nan = torch.full((2, weight.shape[1]), float("nan")).numpy().tobytes()
        data[at:at + len(nan)] = nan
    shard.write_bytes(bytes(data))

    with pytest.raises(CheckpointError) as error:  # FSDP/DDP/megatron/recsys-style load
        load(path)
    assert_one_line_naming(str(error.value), shard.name)
    assert "bytes 0-" in str(error.value) and "do not match their xxh3_128" in str(error.value)
    with pytest.raises(CheckpointError) as error:  # full read: export, consolidate, the ZeRO-3 loader
        read_full(path)
    assert_one_line_naming(str(error.value), shard.name)

    proc = cli("verify", str(path))
    assert proc.returncode == 1 and proc.stdout.count("\n") == 1, proc.stdout + proc.stderr
    assert_one_line_naming(proc.stdout.strip(), shard.name)
    export = cli("export", str(path), str(tmp_path / "out.safetensors"), "--key", "model")
    assert export.returncode == 1 and export.stderr.count("\n") == 1 and f"cannot read {shard.name}" in export.stderr
    assert not (tmp_path / "out.safetensors").exists()

    # Without checksums the same damage loads silently: this is what the manifest catches.
    (path / MANIFEST_FILE).unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded, _ = load(path)
    assert [w.category for w in caught if issubclass(w.category, UnverifiedCheckpointWarning)] == \
        [UnverifiedCheckpointWarning]  # said once for the whole load
    assert not torch.equal(loaded[0].weight, weight)


@pytest.mark.slow
def test_checkpoint_without_manifest_loads_and_says_so_once(checkpoint):
    path, model = checkpoint
    (path / MANIFEST_FILE).unlink()  # as written before checksums existed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded, meta = load(path)
        read_full(path)  # the same folder again in this process: not said twice
    said = [str(w.message) for w in caught if issubclass(w.category, UnverifiedCheckpointWarning)]
    assert len(said) == 1 and "has no manifest.json" in said[0], said
    assert meta == {"step": 1} and torch.equal(loaded[0].weight, model[0].weight)
    proc = cli("verify", str(path))
    assert proc.returncode == 0 and "no manifest.json" in proc.stdout and "cannot be verified" in proc.stdout


@pytest.mark.slow
def test_missing_and_truncated_files_are_named(checkpoint):
    path, _ = checkpoint
    (path / "__0_0.distcp").write_bytes((path / "__0_0.distcp").read_bytes()[:100])
    (path / "meta.pt").unlink()
    proc = cli("verify", str(path))
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 2, proc.stdout
    assert "__0_0.distcp (it has 100 bytes, manifest.json says" in lines[0] and "truncated" in lines[0]
    assert "meta.pt is missing (listed in manifest.json)" in lines[1]


# -- untrusted checkpoints must not run code -------------------------------------------------------------------
class Payload:
    """Unpickling it runs code: creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def rehash(path: Path, name: str) -> None:
    """What an attacker does: make the manifest agree with the crafted file."""
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["files"][name] = {"bytes": (path / name).stat().st_size,
                               "xxh3_128": [xxhash.xxh3_128((path / name).read_bytes()).hexdigest()]}
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.mark.slow
@pytest.mark.parametrize("manifest", ["consistent manifest", "no manifest"])
def test_crafted_metadata_does_not_run_its_payload(checkpoint, tmp_path, manifest):
    path, _ = checkpoint
    live = tmp_path / "payload-is-live"
    pickle.loads(pickle.dumps(Payload(live)))
    assert live.exists()  # plain pickle.load (what DCP's reader does) would run it

    marker = tmp_path / "marker"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    if manifest == "no manifest":
        (path / MANIFEST_FILE).unlink()
    else:
        rehash(path, ".metadata")
    expected = r"^checkpoint '.*ckpt': \.metadata holds builtins\.exec, which DCP metadata never contains; it was not" \
               r" loaded \(the file was crafted or is not DCP's\); load only checkpoints you trust$"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=expected):
            load(path)
        with pytest.raises(CheckpointError, match=expected):
            read_full(path)
        with pytest.raises(CheckpointError, match=expected):
            load_metadata(path)
    export = cli("export", str(path), str(tmp_path / "out.safetensors"), "--key", "model")
    assert export.returncode == 1 and export.stderr.count("\n") == 1 and "holds builtins.exec" in export.stderr
    verify = cli("verify", str(path))
    assert verify.returncode == 1 and "holds builtins.exec" in verify.stdout
    assert not marker.exists()


class _EnumsByName(pickle.Pickler):
    """Pickles enum members as early Python 3.11 releases do (3.11.2, Debian 12's system Python):
    ``getattr(Class, name)``."""

    def reducer_override(self, obj):
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_metadata_written_by_a_python_that_pickles_enums_by_name_loads(checkpoint, tmp_path):
    """DCP's metadata holds an enum (_MEM_FORMAT_ENCODING); Python 3.11.2 (Debian 12's) writes its members as
    getattr(Class, name). Such a checkpoint loads; getattr reaching anything but an enum member is refused."""
    import io

    path, model = checkpoint
    metadata = load_metadata(path)
    buffer = io.BytesIO()
    _EnumsByName(buffer).dump(metadata)
    assert b"getattr" in buffer.getvalue()
    (path / ".metadata").write_bytes(buffer.getvalue())
    rehash(path, ".metadata")
    assert load_metadata(path) == metadata
    loaded, meta = load(path)
    assert meta == {"step": 1} and all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))

    # getattr(Path, "write_text")(Path(marker), "payload"), in pickle's opcodes: what getattr itself would allow
    marker = tmp_path / "written"
    crafted = (f"cbuiltins\ngetattr\n(cpathlib\nPath\nVwrite_text\ntR(cpathlib\nPath\n(V{marker}\ntRVpayload\ntR."
               .encode())
    (path / ".metadata").write_bytes(crafted)
    rehash(path, ".metadata")
    with pytest.raises(CheckpointError, match=r"holds builtins\.getattr of Path\.write_text, which DCP metadata"):
        load_metadata(path)
    assert not marker.exists()
    pickle.loads(crafted)
    assert marker.read_text() == "payload"  # plain pickle would have written it


def test_crafted_non_tensor_item_does_not_run_its_payload(tmp_path):
    model, opt = trained()
    optim = optimizer_state(model, opt)
    lr_key = next(k for k in optim if k.startswith("param_groups.") and k.endswith(".lr"))
    marker = tmp_path / "marker"
    optim[lr_key] = Payload(marker)  # DCP stores non-tensor values as pickled bytes, its planner unpickles them
    path = save_sharded(tmp_path / "ckpt", {"model": model_state(model), "optimizer": optim}, {"step": 1})
    assert verify_checkpoint(path) == path  # the checksums are consistent: only safe unpickling can stop it
    with pytest.raises(CheckpointError, match=rf"item 'optimizer\.{lr_key}' holds an object that safe loading refuses"
                                              r" \(exec\); it was not loaded; if you trust this checkpoint load it"
                                              r" with weights_only=False$"):
        load(path)
    assert not marker.exists()


# -- a kill between the two renames of a same-path save ----------------------------------------------------------
@pytest.fixture(scope="module")
def crashed_swap(tmp_path_factory):
    """The folder a save leaves when it is killed between `path -> .path.old` and `.path.tmp -> path`."""
    root = tmp_path_factory.mktemp("crash_swap")
    path = root / "ckpts" / "last"
    proc = run_python(str(ROOT / "tests/dist/crash_swap.py"), str(root / "out"), str(path), timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert sorted(p.name for p in path.parent.iterdir()) == [".last.old", ".last.tmp"]
    return path


def copy_of(crashed: Path, tmp_path: Path) -> Path:
    shutil.copytree(crashed.parent, tmp_path / "ckpts", symlinks=True)
    return tmp_path / "ckpts" / crashed.name


@pytest.mark.slow
@pytest.mark.parametrize("restart", ["latest_checkpoint", "load", "save"])
def test_killed_swap_is_recovered_by_whatever_a_restart_does_first(crashed_swap, tmp_path, restart):
    path = copy_of(crashed_swap, tmp_path)
    with pytest.warns(UserWarning, match=r"'.*last' was missing after an interrupted save; restored it from"
                                         r" '\.last\.tmp' \(the finished new checkpoint\)"):
        if restart == "latest_checkpoint":
            assert latest_checkpoint(path.parent) == path
        elif restart == "load":
            assert load(path)[1] == {"step": 2}
        else:
            model, opt = trained(seed=3)
            save(path, model, opt, step=3)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last"]
    assert load(path)[1] == {"step": 3 if restart == "save" else 2}
    assert verify_checkpoint(path) == path


@pytest.mark.slow
def test_killed_swap_with_an_unfinished_new_folder_restores_the_old_one(crashed_swap, tmp_path):
    path = copy_of(crashed_swap, tmp_path)
    tmp = path.with_name(".last.tmp")
    (tmp / MANIFEST_FILE).unlink()
    (tmp / "meta.pt").unlink()
    with pytest.warns(UserWarning, match=r"restored it from '\.last\.old' \(the previous checkpoint\)"):
        assert latest_checkpoint(path.parent) == path
    assert load(path)[1] == {"step": 1}
