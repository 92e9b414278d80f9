"""DeepFM as the recsys recipes define it (:class:`DeepFMNet`, also ``disttrain.recsys.DeepFMNet``): one torchrec
embedding table per sparse feature, a bottom MLP on the dense features ending at ``embedding_dim``, an FM term over
all embeddings (no parameters) and a deep MLP over the concatenated embeddings ending in one logit. No tensor or
pipeline split: ``disttrain_recsys`` shards its tables. The planner counts it analytically; exports are plain torch
state dicts.

Written here rather than taken from torchrec: its ``FactorizationMachine`` sums over all embedding dimensions
before squaring (mixing dimensions), and its ``DeepFM`` applies BCE-with-logits after a sigmoid.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from disttrain.config import keys_of
from disttrain.parallel.families.base import Family, Schema
from disttrain.parallel.families.managed_ids import ManagedCollisions, check_ids, managed_tables
from disttrain.parallel.families.spec import ModelSpec
from disttrain.parallel.mesh import ParallelDims

NUM_DENSE, NUM_SPARSE = 13, 26


def fm_interaction(fields: torch.Tensor) -> torch.Tensor:
    """FM second-order term per sample: sum over d of [(sum_i v_id)^2 - sum_i v_id^2] / 2.

    ``fields``: (B, F, D), one D-dim vector per field. Returns (B,). Equal to sum over pairs i<j of <v_i, v_j>.
    """
    square_of_sum = fields.sum(dim=1).pow(2)  # (B, D)
    sum_of_square = fields.pow(2).sum(dim=1)  # (B, D)
    return 0.5 * (square_of_sum - sum_of_square).sum(dim=1)


@torch.fx.wrap
def in_key_order(pooled: Any, keys: list[str]) -> torch.Tensor:
    """The pooled embeddings (a KeyedTensor) as (B, F * D) in ``keys`` order. Sharded tables return their features
    grouped by rank (table-wise: cat_0, cat_2, ... on 2 ranks): put back in order, or the deep tower would compute
    another function under every sharding plan. One call for torch.fx (a leaf), so that torchrec's pipeline can
    trace the network (it compares keys, which a traced value cannot)."""
    if pooled.keys() == keys:
        return pooled.values()
    by_key = pooled.to_dict()
    return torch.cat([by_key[key] for key in keys], dim=1)


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
                 ids: str = "hashed", managed_collisions: Optional[dict[str, Any]] = None,
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
        self.ids = check_ids(ids)
        self.managed_collisions = ManagedCollisions.of(managed_collisions) if ids == "managed" else None
        tables = [EmbeddingBagConfig(name=f"t_{key}", embedding_dim=embedding_dim, num_embeddings=size,
                                     feature_names=[key]) for key, size in zip(self.keys, self.num_embeddings)]
        self.ebc = EmbeddingBagCollection(tables=tables, device=device) if self.managed_collisions is None \
            else managed_tables(tables, self.managed_collisions, device)
        self.bottom = mlp(dense_in_features, bottom_mlp, device)
        fields = len(self.keys) + 1
        self.deep = nn.Sequential(mlp(fields * embedding_dim, deep_mlp, device),
                                  nn.Linear(deep_mlp[-1] if deep_mlp else fields * embedding_dim, 1, device=device))
        self.linear = nn.Linear(dense_in_features, 1, device=device)

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        pooled = self.ebc(sparse)
        if isinstance(pooled, tuple):  # managed tables: (pooled, remapped ids when asked for)
            pooled = pooled[0]
        pooled = in_key_order(pooled, self.keys)  # (B, F * D)
        batch = dense.shape[0]
        fields = torch.cat([self.bottom(dense).unsqueeze(1), pooled.view(batch, -1, self.embedding_dim)], dim=1)
        # fields: (B, F + 1, D)
        deep = self.deep(fields.flatten(1)).squeeze(1)
        return deep + fm_interaction(fields) + self.linear(dense).squeeze(1)



# The recipe's ``model:`` section: DeepFMNet's keyword arguments (``device`` aside); sparse_optimizer is the fused
# optimizer's mapping (fused_params).
MODEL_SCHEMA: Schema = {**keys_of(DeepFMNet, exclude=["device"]),
                        "sparse_optimizer": dict.fromkeys(("name", "lr", "eps")),
                        "managed_collisions": keys_of(ManagedCollisions)}
# DeepFMNet's defaults for the keys a config may leave out.
DEFAULTS = {name: p.default for name, p in inspect.signature(DeepFMNet).parameters.items()
            if name in ("dense_in_features", "bottom_mlp", "deep_mlp")}


def _need(mapping: Mapping[str, Any], key: str) -> Any:
    if key not in mapping:
        raise ValueError(f"the DeepFM config lacks {key!r}; add it to the `model:` mapping")
    return mapping[key]


def _mlp_params(widths: list[int]) -> int:
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def deepfm_spec(cfg: Mapping[str, Any]) -> ModelSpec:
    """The spec of a ``model:`` mapping of DeepFMNet's arguments (its defaults where a key is absent)."""
    dim = int(_need(cfg, "embedding_dim"))
    rows = tuple(int(n) for n in _need(cfg, "num_embeddings_per_feature"))
    if not rows or min(rows) < 1:
        raise ValueError(f"num_embeddings_per_feature={list(rows)} must list one positive size per sparse feature")
    dense_in = int(cfg.get("dense_in_features", DEFAULTS["dense_in_features"]))
    bottom = [int(w) for w in cfg.get("bottom_mlp", DEFAULTS["bottom_mlp"])]
    deep = [int(w) for w in cfg.get("deep_mlp", DEFAULTS["deep_mlp"])]
    dense = _mlp_params([dense_in, *bottom])
    dense += _mlp_params([(len(rows) + 1) * dim, *deep, 1])
    dense += dense_in + 1  # the first-order term on the dense features
    params = sum(rows) * dim + dense
    return ModelSpec("deepfm", params, embedding_dim=dim, table_rows=rows, dense_params=dense,
                     dense_in_features=dense_in, mlp_widths=tuple(bottom + deep + [1]), tokens=1)


class DeepFMFamily(Family):
    name = "deepfm"
    analytic = True

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, DeepFMNet)

    def reads_config(self, mapping: Mapping[str, Any]) -> bool:
        return "model_type" not in mapping and "num_embeddings_per_feature" in mapping

    def config_schema(self, mapping: Mapping[str, Any]) -> Schema:
        return MODEL_SCHEMA

    def spec_from_config(self, mapping: Mapping[str, Any]) -> ModelSpec:
        return deepfm_spec(mapping)

    def meta_model(self, mapping: Mapping[str, Any]) -> nn.Module:
        return DeepFMNet(**mapping, device="meta")

    def spec_from_module(self, module: nn.Module) -> ModelSpec:
        def widths(seq: nn.Module) -> list[int]:
            return [m.out_features for m in seq.modules() if isinstance(m, nn.Linear)]

        return deepfm_spec({"embedding_dim": module.embedding_dim,
                            "num_embeddings_per_feature": module.num_embeddings,
                            "dense_in_features": module.linear.in_features, "bottom_mlp": widths(module.bottom),
                            "deep_mlp": widths(module.deep)[:-1]})

    def activation_bytes(self, spec: ModelSpec, micro_batch: int, seq_len: int, compute_bytes: int,
                         activation_checkpointing: bool, dims: ParallelDims) -> int:
        features = len(spec.table_rows) + 1
        per_sample = 3 * features * spec.embedding_dim + 2 * sum(spec.mlp_widths) + spec.dense_in_features
        return int(micro_batch * (per_sample * compute_bytes + 8 * len(spec.table_rows)))

    def flops_per_sample(self, spec: ModelSpec, seq_len: int) -> float:
        return 6.0 * spec.dense_params


DEEPFM = DeepFMFamily()
