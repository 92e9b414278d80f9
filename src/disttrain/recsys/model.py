"""DeepFM: torchrec embedding tables, a bottom MLP for dense features, a per-dimension FM term and a deep tower.

Written here rather than taken from torchrec: its ``FactorizationMachine`` sums over all embedding dimensions
before squaring (mixing dimensions), and its ``DeepFM`` applies BCE-with-logits after a sigmoid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Union

import lightning as L
import torch
from torch import nn

from disttrain.config import Recipe, Schema, keys_of
from disttrain.parallel.recsys import dense_parameters

NUM_DENSE, NUM_SPARSE = 13, 26


def fm_interaction(fields: torch.Tensor) -> torch.Tensor:
    """FM second-order term per sample: sum over d of [(sum_i v_id)^2 - sum_i v_id^2] / 2.

    ``fields``: (B, F, D), one D-dim vector per field. Returns (B,). Equal to sum over pairs i<j of <v_i, v_j>.
    """
    square_of_sum = fields.sum(dim=1).pow(2)  # (B, D)
    sum_of_square = fields.pow(2).sum(dim=1)  # (B, D)
    return 0.5 * (square_of_sum - sum_of_square).sum(dim=1)


def mlp(in_features: int, widths: Sequence[int], device: Optional[torch.device] = None) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in widths:
        layers += [nn.Linear(in_features, width, device=device), nn.ReLU()]
        in_features = width
    return nn.Sequential(*layers)


def feature_names(count: int = NUM_SPARSE) -> list[str]:
    return [f"cat_{i}" for i in range(count)]


def to_kjt(sparse: torch.Tensor, keys: Sequence[str]) -> Any:
    """(B, F) ids, one per feature and sample -> the KeyedJaggedTensor the tables take (feature-major values)."""
    from torchrec import KeyedJaggedTensor

    batch, count = sparse.shape
    lengths = torch.ones(batch * count, dtype=torch.int32, device=sparse.device)
    return KeyedJaggedTensor(keys=list(keys), values=sparse.t().reshape(-1), lengths=lengths)


class DeepFMNet(nn.Module):
    """The network, a plain ``nn.Module`` (what DistributedModelParallel shards).

    ``forward(dense (B, 13) float, sparse KeyedJaggedTensor with one id per feature) -> logits (B,)``.
    The bottom MLP maps dense features to one more ``embedding_dim`` field that joins the FM term and the deep
    tower; a linear first-order term on the dense features completes the logit.
    ``sparse_optimizer`` (e.g. ``{"name": "rowwise_adagrad", "lr": 0.05}``) is the tables' fused optimizer.
    """

    def __init__(self, embedding_dim: int, num_embeddings_per_feature: Sequence[int],
                 dense_in_features: int = NUM_DENSE, bottom_mlp: Sequence[int] = (64,),
                 deep_mlp: Sequence[int] = (128, 64), sparse_optimizer: Optional[dict[str, Any]] = None,
                 device: Optional[Union[str, torch.device]] = None) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        bottom_mlp, deep_mlp = list(bottom_mlp), list(deep_mlp)
        if not bottom_mlp or bottom_mlp[-1] != embedding_dim:
            raise ValueError(f"bottom_mlp={bottom_mlp} must end with embedding_dim={embedding_dim}: its output is"
                             f" one more FM field; e.g. bottom_mlp: [{max(2 * embedding_dim, 32)}, {embedding_dim}]")
        if not num_embeddings_per_feature or min(num_embeddings_per_feature) < 1:
            raise ValueError(f"num_embeddings_per_feature={list(num_embeddings_per_feature)} needs one positive"
                             " table size per sparse feature")
        device = torch.device(device) if device is not None else None
        self.keys = feature_names(len(num_embeddings_per_feature))
        self.num_embeddings = list(num_embeddings_per_feature)
        self.embedding_dim = embedding_dim
        self.sparse_optimizer = dict(sparse_optimizer or {})
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{key}", embedding_dim=embedding_dim, num_embeddings=size,
                                       feature_names=[key]) for key, size in zip(self.keys, self.num_embeddings)],
            device=device)
        self.bottom = mlp(dense_in_features, bottom_mlp, device)
        fields = len(self.keys) + 1
        self.deep = nn.Sequential(mlp(fields * embedding_dim, deep_mlp, device),
                                  nn.Linear(deep_mlp[-1] if deep_mlp else fields * embedding_dim, 1, device=device))
        self.linear = nn.Linear(dense_in_features, 1, device=device)

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        pooled = self.ebc(sparse)
        # Sharded tables return their features grouped by rank (table-wise: cat_0, cat_2, ... on 2 ranks): put them
        # back in self.keys order, or the deep tower would compute another function under every sharding plan.
        if pooled.keys() == self.keys:
            pooled = pooled.values()  # (B, F * D)
        else:
            by_key = pooled.to_dict()
            pooled = torch.cat([by_key[key] for key in self.keys], dim=1)
        batch = dense.shape[0]
        fields = torch.cat([self.bottom(dense).unsqueeze(1), pooled.view(batch, -1, self.embedding_dim)], dim=1)
        # fields: (B, F + 1, D)
        deep = self.deep(fields.flatten(1)).squeeze(1)
        return deep + fm_interaction(fields) + self.linear(dense).squeeze(1)


# The model: section: DeepFMNet's arguments; sparse_optimizer is the fused optimizer's mapping (fused_params).
MODEL_SCHEMA: Schema = {**keys_of(DeepFMNet, exclude=["device"]),
                        "sparse_optimizer": dict.fromkeys(("name", "lr", "eps"))}


def recipe_schema() -> Schema:
    """What a DeepFM recipe YAML may hold (see :mod:`disttrain.config`)."""
    from disttrain.parallel.recsys import RecsysOptions
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


class DeepFM(L.LightningModule):
    """DeepFM for ``lightning.Trainer`` with ``strategy="disttrain_recsys"``.

    Pass the model config (a recipe YAML path or its ``model:`` mapping) and the dense optimizer's ``lr``. Batches
    are ``(dense (B, 13) float, sparse (B, 26) int64 ids already hashed to the table sizes, labels (B,) float)``.
    The tables are trained by the fused sparse optimizer inside backward; ``configure_optimizers`` returns Adam
    over the dense parameters only.
    """

    def __init__(self, config: Union[str, Path, dict[str, Any]], lr: float = 1e-3,
                 device: Optional[Union[str, torch.device]] = None) -> None:
        super().__init__()
        self.model_config = load_model_config(config)
        self.save_hyperparameters({"model": self.model_config, "lr": lr})
        self.lr = lr
        self.table_sizes = list(self.model_config["num_embeddings_per_feature"])  # readable after DMP wraps net
        self.net = DeepFMNet(**self.model_config, device=device)
        self.loss_fn = nn.BCEWithLogitsLoss()
        self._dense_optimizer: Optional[torch.optim.Optimizer] = None

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.net(dense, to_kjt(sparse, feature_names(sparse.shape[1])))

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        dense, sparse, labels = batch
        loss = self.loss_fn(self(dense, sparse), labels)
        self.log("train_loss", loss, batch_size=labels.shape[0])
        return loss

    def validation_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        dense, sparse, labels = batch
        self.log("val_loss", self.loss_fn(self(dense, sparse), labels), sync_dist=True, batch_size=labels.shape[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Kept across fits: the daily job fits the same module once per day, and Adam's moments carry over.
        params = dense_parameters(self)
        if self._dense_optimizer is None or \
                {id(p) for g in self._dense_optimizer.param_groups for p in g["params"]} != {id(p) for p in params}:
            self._dense_optimizer = torch.optim.Adam(params, lr=self.lr)
        return self._dense_optimizer
