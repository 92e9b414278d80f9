"""Lightning callbacks a strategy cannot serve are refused before training, with the reason and the way out."""

import lightning.pytorch as pl
import pytest
import torch

from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import disttrain  # noqa: F401  (registers the disttrain_* names)


def trainer(tmp_path, strategy, **kwargs):
    return pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, limit_train_batches=2,
                      limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, **kwargs)


@pytest.mark.parametrize("strategy", ["disttrain_fsdp", "disttrain_megatron"])
def test_swa_is_refused_where_parameters_are_sharded(tmp_path, strategy):
    model = BoringModel()
    before = [p.detach().clone() for p in model.parameters()]
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
    with pytest.raises(MisconfigurationException, match=rf"StochasticWeightAveraging cannot run under {strategy}:"
                       r" .* use disttrain_ddp"):
        trainer(tmp_path, strategy, callbacks=[swa]).fit(model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # refused before any step


def test_swa_still_runs_under_disttrain_ddp(tmp_path):
    model = BoringModel()
    trainer(tmp_path, "disttrain_ddp", callbacks=[StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)]).fit(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_lr_finder_is_refused_under_zero3(tmp_path):
    with pytest.raises(MisconfigurationException, match=r"LearningRateFinder cannot run under disttrain_zero3: .*"
                       r"find the rate under disttrain_fsdp or disttrain_ddp"):
        Tuner(trainer(tmp_path, "disttrain_zero3")).lr_find(BoringModel(), num_training=5, update_attr=False)


def test_lr_finder_runs_under_disttrain_fsdp(tmp_path):
    finder = Tuner(trainer(tmp_path, "disttrain_fsdp")).lr_find(BoringModel(), num_training=5, update_attr=False)
    assert finder is not None and len(finder.results["lr"]) > 0
