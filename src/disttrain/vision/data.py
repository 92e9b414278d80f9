"""Image data for the ViT trainer: ImageFolder trees (``train/`` and ``val/``, one sub-folder per class), timm's
transforms and augmentation, and the demo data: the package's 1,797 handwritten digits written as such a tree.

Distributed sampling comes from the entry point: the Trainer and ``fabric.setup_dataloaders`` put a
``DistributedSampler`` over the data-parallel ranks (``strategy.distributed_sampler_kwargs``) on these loaders.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
from torch.utils.data import DataLoader, DistributedSampler

from disttrain.parallel.options import build_options

SPLITS = ("train", "val")
_DONE = ".complete"  # written last: a tree without it was interrupted and is written again


@dataclass
class DataConfig:
    """The ``data:`` section.

    root: an ImageFolder tree with ``train/`` and ``val/``, each holding one sub-folder of images per class.
    digits: write the package's digits into ``root`` when it is missing (the demo data; never overwrites).
    batch_size: images per process per step. num_workers: DataLoader worker processes.
    mean, std: normalisation. scale, ratio: RandomResizedCrop's area and aspect ranges. hflip: horizontal flip
    probability. rand_augment: a timm RandAugment spec such as "rand-m9-mstd0.5-inc1" (None: off).
    mixup, cutmix: alpha of timm's Mixup/CutMix (0: off); label_smoothing is then applied by Mixup.
    """

    root: str = "data/digits"
    digits: bool = False
    batch_size: int = 32
    num_workers: int = 0
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    ratio: list[float] = field(default_factory=lambda: [3 / 4, 4 / 3])
    hflip: float = 0.5
    rand_augment: Optional[str] = None
    mixup: float = 0.0
    cutmix: float = 0.0
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"data: batch_size={self.batch_size} must be at least 1")
        if (self.mixup or self.cutmix) and self.batch_size % 2:
            raise ValueError(f"data: batch_size={self.batch_size} is odd but mixup/cutmix pairs images within a"
                             " batch; choose an even batch_size")
        if self.rand_augment is not None and not str(self.rand_augment).startswith("rand"):
            raise ValueError(f"data: rand_augment={self.rand_augment!r} is not a RandAugment spec; use e.g."
                             " 'rand-m9-mstd0.5-inc1', or null for none")


def data_config(section: Optional[dict[str, Any]], **overrides: Any) -> DataConfig:
    values = {**(section or {}), **{k: v for k, v in overrides.items() if v is not None}}
    return build_options(DataConfig, "data:", values)


class SkippingSampler(DistributedSampler):
    """A ``DistributedSampler`` (this rank's share, in its epoch's order) whose next epoch can start part-way:
    set ``skip`` to the number of this rank's samples to leave out of it (those a resumed run trained on before its
    checkpoint); they are not loaded. Later epochs start at their beginning again."""

    skip: int = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


def write_digits(root: Union[str, os.PathLike], size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> Path:
    """Write the package's 1,797 handwritten digits (8x8, 0-16) as ``size`` x ``size`` RGB PNGs into
    ``root/{train,val}/<d>/``.

    The digits are UCI's "Optical Recognition of Handwritten Digits" test set (CC BY 4.0), the images scikit-learn's
    ``load_digits`` returns, shipped as ``digits.npz`` (``tools/digits_data.py`` wrote it). The split is stratified
    (:func:`stratified_split`, drawn with ``seed``). The tree is written in a temporary
    folder and renamed into place, so a reader never sees half of it; an existing complete tree is kept. Call from
    one process.
    """
    import numpy as np
    from PIL import Image

    root = Path(root)
    if (root / _DONE).is_file():
        return root
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{str(root)!r} exists but is not a complete digits tree (no {_DONE}); remove it"
                              " or point data.root at an empty or missing folder")
    images, labels = load_digits()
    train, val = stratified_split(labels, val_fraction, seed)
    tmp = root.with_name(f".{root.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    for split, rows in (("train", train), ("val", val)):
        for label in range(10):
            (tmp / split / str(label)).mkdir(parents=True)
        for i in rows:
            grey = (images[i] * (255.0 / 16.0)).astype(np.uint8)  # (8, 8), 0..255
            image = Image.fromarray(grey, mode="L").resize((size, size), Image.BILINEAR).convert("RGB")
            image.save(tmp / split / str(labels[i]) / f"{i:04d}.png")
    (tmp / _DONE).write_text(f"UCI digits, {size}x{size} RGB, val_fraction={val_fraction}, seed={seed}\n")
    if root.exists():
        root.rmdir()  # empty (checked above)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(root)
    return root


def load_digits() -> tuple[Any, Any]:
    """The shipped digits: (images (1797, 8, 8) uint8 of counts 0-16, labels (1797,) uint8)."""
    import numpy as np

    with np.load(Path(__file__).with_name("digits.npz"), allow_pickle=False) as data:
        return data["images"], data["labels"]


def stratified_split(labels: Any, val_fraction: float, seed: int) -> tuple[Any, Any]:
    """(train indices, val indices), both sorted: ``ceil(val_fraction x N)`` of the N indices go to val, shared among
    the labels in proportion to their counts (the largest remainders get the rounding), each label's drawn with
    ``seed``. These are the sizes scikit-learn's ``train_test_split(stratify=...)`` gives; the package does not depend
    on scikit-learn, which brings scipy, which torchmetrics imports when installed: every process that imports
    Lightning paid ~0.9 s of CPU for it."""
    import numpy as np

    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must lie between 0 and 1 (e.g. 0.2)")
    classes, counts = np.unique(labels, return_counts=True)
    held_out = math.ceil(val_fraction * len(labels))
    quota = counts * (held_out / len(labels))
    sizes = np.floor(quota).astype(np.int64)
    sizes[np.argsort(sizes - quota, kind="stable")[:held_out - sizes.sum()]] += 1
    rng = np.random.default_rng(seed)
    held = np.zeros(len(labels), dtype=bool)
    for label, size in zip(classes, sizes):
        held[rng.choice(np.flatnonzero(labels == label), size=int(size), replace=False)] = True
    return np.flatnonzero(~held), np.flatnonzero(held)


def transforms(config: DataConfig, img_size: int) -> tuple[Any, Any]:
    """timm's (train, eval) transforms: RandomResizedCrop, flip and optional RandAugment for training; resize
    and centre crop for evaluation; both normalised with ``mean``/``std``."""
    from timm.data import create_transform

    common = dict(input_size=img_size, mean=tuple(config.mean), std=tuple(config.std), interpolation="bilinear")
    train = create_transform(is_training=True, scale=tuple(config.scale), ratio=tuple(config.ratio),
                             hflip=config.hflip, auto_augment=config.rand_augment, **common)
    evaluate = create_transform(is_training=False, crop_pct=1.0, **common)
    return train, evaluate


def mixup_fn(config: DataConfig, num_classes: int) -> Any:
    """timm's Mixup/CutMix (soft targets, label smoothing included), or None when both are off."""
    if not (config.mixup or config.cutmix):
        return None
    from timm.data import Mixup

    return Mixup(mixup_alpha=config.mixup, cutmix_alpha=config.cutmix, label_smoothing=config.label_smoothing,
                 num_classes=num_classes)


class ImageFolderData(L.LightningDataModule):
    """``train`` and ``val`` ImageFolder datasets with timm transforms, for the Trainer (``datamodule=``) and for
    Fabric (``prepare_data()``, ``setup()``, then the two loaders through ``fabric.setup_dataloaders``)."""

    def __init__(self, config: DataConfig, img_size: int, num_classes: int) -> None:
        super().__init__()
        self.config, self.img_size, self.num_classes = config, img_size, num_classes
        self.train_set: Any = None
        self.val_set: Any = None

    def prepare_data(self) -> None:
        """Write the digits tree when asked to and it is missing (the Trainer calls this on one process)."""
        root = Path(self.config.root)
        if self.config.digits:
            write_digits(root, size=self.img_size)
        missing = [s for s in SPLITS if not (root / s).is_dir()]
        if missing:
            raise FileNotFoundError(
                f"data.root={str(root)!r} has no {' or '.join(f'{m}/' for m in missing)} folder; pass an ImageFolder"
                " tree (train/<class>/*.png, val/<class>/*.png), or set data.digits: true to write the demo data")

    def setup(self, stage: Optional[str] = None) -> None:
        from torchvision.datasets import ImageFolder

        train_tf, eval_tf = transforms(self.config, self.img_size)
        root = Path(self.config.root)
        self.train_set = ImageFolder(str(root / "train"), transform=train_tf)
        self.val_set = ImageFolder(str(root / "val"), transform=eval_tf)
        for name, dataset in (("train", self.train_set), ("val", self.val_set)):
            if len(dataset.classes) != self.num_classes:
                raise ValueError(f"{str(root / name)!r} has {len(dataset.classes)} class folders but model.num_classes"
                                 f" is {self.num_classes}; set model.num_classes: {len(dataset.classes)}")
        if self.train_set.classes != self.val_set.classes:
            raise ValueError(f"train/ and val/ under {str(root)!r} have different class folders:"
                             f" {self.train_set.classes} vs {self.val_set.classes}")

    @property
    def classes(self) -> list[str]:
        return list(self.train_set.classes)

    def train_dataloader(self) -> DataLoader:
        # drop_last: mixup needs even batches, and equal batch counts on every rank keep collectives in step.
        return DataLoader(self.train_set, batch_size=self.config.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.config.num_workers, persistent_workers=self.config.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.config.batch_size, shuffle=False,
                          num_workers=self.config.num_workers, persistent_workers=self.config.num_workers > 0)

