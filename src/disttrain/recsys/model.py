"""DeepFM as a LightningModule (``DeepFM``) and its recipe YAML; the network itself, ``DeepFMNet`` (torchrec
embedding tables, a bottom MLP for dense features, a per-dimension FM term and a deep tower), is the torch-only
:mod:`disttrain.parallel.families.deepfm`, which the planner and the simulator build too."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Union

import lightning as L
import torch
from torch import nn

from disttrain.config import Recipe, Schema, keys_of
from disttrain.parallel.engines.recsys import dense_parameters
from disttrain.parallel.engines.sparse_pipeline import TableBatch
from disttrain.parallel.families.deepfm import MODEL_SCHEMA, DeepFMNet, feature_names, to_kjt
from disttrain.parallel.families.managed_ids import id_space


def recipe_schema() -> Schema:
    """What a DeepFM recipe YAML may hold (see :mod:`disttrain.config`)."""
    from disttrain.parallel.engines.recsys import RecsysOptions
    from disttrain.recsys.defaults import DAILY_DEFAULTS, TRAIN_DEFAULTS
    from disttrain.recsys.validate import ValidationBounds

    return {"model": MODEL_SCHEMA, "train": dict.fromkeys(TRAIN_DEFAULTS), "strategy": keys_of(RecsysOptions),
            "daily": {**dict.fromkeys(DAILY_DEFAULTS), "validation": keys_of(ValidationBounds)}}


DEEPFM_RECIPE = Recipe("deepfm", "configs/recsys/deepfm_tiny.yaml", recipe_schema)


def load_model_config(config: Union[str, Path, dict[str, Any]]) -> dict[str, Any]:
    """The ``model:`` mapping of a recipe YAML (or a dict that is either the whole recipe or that mapping); an
    unknown key is one error with the closest valid key."""
    return DEEPFM_RECIPE.model(config)


def nonfinite_values(module: nn.Module, device: Optional[torch.device] = None) -> dict[str, tuple[int, int]]:
    """``{name: (non-finite values, all values)}`` for every floating-point tensor of ``module``'s state dict,
    counted over all ranks (a collective when a process group runs: call it on every rank). Sharded
    tables (torchrec's ShardedTensor, DTensor) are counted over their shards on all ranks; other tensors are
    replicated and counted once. ``device``: where the counts are reduced (the process group's device)."""
    import torch.distributed as dist

    names, counts, sharded = [], [], []
    for name, value in module.state_dict().items():
        if not isinstance(value, torch.Tensor):
            continue
        parts, is_sharded = _local_parts(value)
        if not all(t.is_floating_point() or t.is_complex() for t in parts):
            continue
        names.append(name)
        counts.append([sum(int((~torch.isfinite(t)).sum()) for t in parts), sum(t.numel() for t in parts)])
        sharded.append(is_sharded)
    table = torch.tensor(counts or [[0, 0]], dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and names:
        mask = torch.tensor(sharded, dtype=torch.bool, device=device).unsqueeze(1)
        summed = torch.where(mask, table, torch.zeros_like(table))
        dist.all_reduce(summed)
        table = torch.where(mask, summed, table)
    return {name: (int(bad), int(total)) for name, (bad, total) in zip(names, table.tolist())}


def _local_parts(value: torch.Tensor) -> tuple[list[torch.Tensor], bool]:
    """(the tensors this rank holds of ``value``, whether ``value`` is sharded across ranks)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return [value.to_local()], True
    if hasattr(value, "local_shards"):  # torchrec's ShardedTensor
        return [shard.tensor for shard in value.local_shards()], True
    return [value], False


def table_batch(batch: Sequence[torch.Tensor]) -> TableBatch:
    """A DeepFM batch ``(dense, sparse ids, labels)`` as torchrec's training pipeline moves it: the ids as the
    KeyedJaggedTensor the tables take, fields named after ``DeepFMNet.forward``'s arguments (``dense``, ``sparse``)."""
    dense, sparse, labels = batch
    return TableBatch(dense, to_kjt(sparse, feature_names(sparse.shape[1])), labels, source=batch)


class DeepFM(L.LightningModule):
    """DeepFM for ``lightning.Trainer`` with ``strategy="disttrain_recsys"``.

    Pass the model config (a recipe YAML path or its ``model:`` mapping) and the dense optimizer's ``lr``. Batches
    are ``(dense (B, 13) float, sparse (B, 26) int64 ids already hashed to ``table_sizes``, labels (B,) float)``.
    The tables are trained by the fused sparse optimizer inside backward; ``configure_optimizers`` returns Adam
    over the dense parameters only.
    """

    def __init__(self, config: Union[str, Path, dict[str, Any]], lr: float = 1e-3,
                 device: Optional[Union[str, torch.device]] = None) -> None:
        super().__init__()
        self.model_config = load_model_config(config)
        self.save_hyperparameters({"model": self.model_config, "lr": lr})
        self.lr = lr
        # What the data path takes raw ids modulo (readable after DMP wraps net): the table sizes for hashed ids, the
        # input hash size for managed ones.
        self.table_sizes = id_space(self.model_config)
        self.net = DeepFMNet(**self.model_config, device=device)
        self.loss_fn = nn.BCEWithLogitsLoss()
        self._dense_optimizer: Optional[torch.optim.Optimizer] = None

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.net(dense, to_kjt(sparse, feature_names(sparse.shape[1])))

    def pipeline_batch(self, batch: Sequence[torch.Tensor]) -> TableBatch:
        """The loader's batch as torchrec's training pipeline moves it (``pipeline="sparse_dist"``)."""
        return table_batch(batch)

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        dense, sparse, labels = batch
        loss = self.loss_fn(self(dense, sparse), labels)
        if self._logged_this_step():
            self.log("train_loss", loss, batch_size=labels.shape[0])
        return loss

    def _logged_this_step(self) -> bool:
        """Whether a logger writes this step's ``train_loss``: at the trainer's ``log_every_n_steps`` (the step
        Lightning writes at) when it has a logger. A recommender's steps are short (~10 ms on a CPU core) and
        ``self.log`` costs ~1 ms of Python each, for a value no logger reads between those steps; so
        ``trainer.callback_metrics["train_loss"]`` is the last logged step's."""
        trainer = self.trainer
        every = trainer.log_every_n_steps
        return bool(trainer.loggers) and every > 0 and ((trainer.global_step + 1) % every == 0 or trainer.should_stop)

    def validation_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        dense, sparse, labels = batch
        self.log("val_loss", self.loss_fn(self(dense, sparse), labels), sync_dist=True, batch_size=labels.shape[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Kept across fits: the daily job fits the same module once per day, and Adam's moments carry over.
        params = dense_parameters(self)
        if self._dense_optimizer is None or \
                {id(p) for g in self._dense_optimizer.param_groups for p in g["params"]} != {id(p) for p in params}:
            # fused: one kernel for every parameter (torch's default on a CPU is a Python loop over them, ~1 ms a
            # step for DeepFM's dozen tensors); fp32 math either way
            self._dense_optimizer = torch.optim.Adam(params, lr=self.lr, fused=_fused_adam(params))
        return self._dense_optimizer


def _fused_adam(params: Sequence[torch.Tensor]) -> Optional[bool]:
    """True where torch's fused Adam takes every parameter (floating point, on a CPU or CUDA device), else None
    (torch's own choice)."""
    fine = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return True if fine else None
