"""Fine-tuning a tiny ViT from a timm checkpoint under each strategy (Fabric), against one process in this script.

Usage: vit_pretrained_run.py OUT SPEC [SPEC ...]

Rank 0 saves a tiny timm ViT in bfloat16 three ways: a hub folder (config.json + model.safetensors, timm's
``save_for_hf``), a ``torch.save`` .pth file, and one .safetensors file of the same ViT with 1000 classes. Per SPEC,
as the recipe does it: the ``ViTClassifier`` is built empty, set up with its optimizer, then loaded with
``load_timm_checkpoint`` (each rank reading its own slices, bfloat16 to float32 slice by slice) and trained 4 SGD
steps on the same batches as one process that loads the same weights with ``load_state_dict``; the .pth is loaded
the same way under the first SPEC. Then the 1000-class file goes into a fresh 10-class model: its export holds the
checkpoint's tensors everywhere but in the head.
"""

import os
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

import disttrain  # noqa: F401  (registers the strategy names)
from disttrain.vision import TrainConfig, ViTClassifier, build_vit, load_timm_checkpoint, timm_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
from common import strategy_from_spec, tmpdir, write_result  # noqa: E402

specs = sys.argv[2:]
MODEL = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0, num_classes=10)
STEPS, LR = 4, 0.05
FOLDER = Path(tmpdir()) / "vit-hub"
TORCH_FILE = Path(tmpdir()) / "vit.pth"
OTHER_CLASSES = Path(tmpdir()) / "vit-1000.safetensors"


def saved_model(num_classes: int = 10) -> torch.nn.Module:
    torch.manual_seed(7)
    return build_vit({**MODEL, "num_classes": num_classes}).to(torch.bfloat16)


def save_checkpoints() -> None:
    from safetensors.torch import save_file
    from timm.models import save_for_hf

    save_for_hf(saved_model(), str(FOLDER), model_args=MODEL, safe_serialization=True)
    torch.save(saved_model().state_dict(), TORCH_FILE)
    save_file(saved_model(1000).state_dict(), str(OTHER_CLASSES))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)


def reference_losses() -> list[float]:
    from safetensors.torch import load_file

    model = build_vit(MODEL)
    model.load_state_dict({k: v.float() for k, v in load_file(str(FOLDER / "model.safetensors")).items()})
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        images, labels = batch(step)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def set_up(fabric: L.Fabric):
    """The recipe's order: built empty, set up with the optimizer, then loaded."""
    vit = ViTClassifier(MODEL, TrainConfig())
    with fabric.init_module(empty_init=True):
        vit.configure_model()
    return fabric.setup(vit, torch.optim.SGD(vit.parameters(), lr=LR, momentum=0.9))


def fine_tune(fabric: L.Fabric, path: Path) -> list[float]:
    model, optimizer = set_up(fabric)
    load_timm_checkpoint(fabric, model, timm_checkpoint(path, MODEL))
    losses = []
    for step in range(STEPS):  # every rank the same batch: the averaged gradient is the one-process gradient
        loss = model.training_step(fabric.to_device(batch(step)), step)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def new_head(fabric: L.Fabric, out: Path) -> dict:
    """The 1000-class file into the 10-class model: which exported tensors equal the checkpoint's."""
    from safetensors.torch import load_file

    checkpoint = timm_checkpoint(OTHER_CLASSES, MODEL)
    model, _ = set_up(fabric)
    load_timm_checkpoint(fabric, model, checkpoint)
    fabric.strategy.export_full(model, out, prefix="model.")
    if fabric.global_rank != 0:
        return {"note": checkpoint.note, "exclude": list(checkpoint.exclude)}
    saved, loaded = load_file(str(OTHER_CLASSES)), load_file(str(out))
    return {"note": checkpoint.note, "exclude": list(checkpoint.exclude),
            "equal": sorted(k for k in loaded if torch.equal(loaded[k], saved[k].float())),
            "head_shape": list(loaded["head.weight"].shape),
            "head_finite": bool(loaded["head.weight"].isfinite().all()), "names": sorted(loaded)}


if int(os.environ.get("RANK", "0")) == 0:
    save_checkpoints()
results = {}
for i, spec in enumerate(specs):
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                      strategy=strategy_from_spec(spec, "fabric"))
    fabric.launch()
    fabric.barrier()  # rank 0 wrote the checkpoints
    if i == 0:
        results["ref_losses"] = reference_losses()
    results[spec] = {"folder": fine_tune(fabric, FOLDER),
                     "new_head": new_head(fabric, Path(tmpdir()) / f"export-{i}.safetensors")}
    if i == 0:
        results[spec]["torch_file"] = fine_tune(fabric, TORCH_FILE)
        results[spec]["temporary_left"] = sorted(p.name for p in Path(tempfile.gettempdir()).glob(
            "disttrain-pretrained-*") if (p / "model.safetensors").is_file())
write_result(results)
