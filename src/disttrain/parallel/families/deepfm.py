"""DeepFM as the recsys recipes define it (``disttrain.recsys.DeepFMNet``): one torchrec embedding table per sparse
feature, a bottom MLP on the dense features ending at ``embedding_dim``, an FM term over all embeddings (no
parameters) and a deep MLP over the concatenated embeddings ending in one logit. No tensor or pipeline split:
``disttrain_recsys`` shards its tables. The planner counts it analytically; exports are plain torch state dicts."""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from disttrain.parallel.families.base import Family, Schema
from disttrain.parallel.families.spec import ModelSpec

# DeepFMNet's keyword arguments (``device`` aside), the recipe's ``model:`` section; sparse_optimizer is the fused
# optimizer's mapping (fused_params). The recsys trainer checks this against DeepFMNet's signature.
MODEL_SCHEMA: Schema = {"embedding_dim": None, "num_embeddings_per_feature": None, "dense_in_features": None,
                        "bottom_mlp": None, "deep_mlp": None, "sparse_optimizer": dict.fromkeys(("name", "lr", "eps"))}
# DeepFMNet's defaults for the keys a config may leave out.
DEFAULTS = {"dense_in_features": 13, "bottom_mlp": (64,), "deep_mlp": (128, 64)}


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
        return type(model).__name__ == "DeepFMNet" and type(model).__module__.startswith("disttrain.recsys")

    def reads_config(self, mapping: Mapping[str, Any]) -> bool:
        return "model_type" not in mapping and "num_embeddings_per_feature" in mapping

    def config_schema(self, mapping: Mapping[str, Any]) -> Schema:
        return MODEL_SCHEMA

    def spec_from_config(self, mapping: Mapping[str, Any]) -> ModelSpec:
        return deepfm_spec(mapping)

    def spec_from_module(self, module: nn.Module) -> ModelSpec:
        def widths(seq: nn.Module) -> list[int]:
            return [m.out_features for m in seq.modules() if isinstance(m, nn.Linear)]

        return deepfm_spec({"embedding_dim": module.embedding_dim,
                            "num_embeddings_per_feature": module.num_embeddings,
                            "dense_in_features": module.linear.in_features, "bottom_mlp": widths(module.bottom),
                            "deep_mlp": widths(module.deep)[:-1]})

    def activation_bytes(self, spec: ModelSpec, micro_batch: int, seq_len: int, compute_bytes: int,
                         activation_checkpointing: bool, tensor_parallel_size: int) -> int:
        features = len(spec.table_rows) + 1
        per_sample = 3 * features * spec.embedding_dim + 2 * sum(spec.mlp_widths) + spec.dense_in_features
        return int(micro_batch * (per_sample * compute_bytes + 8 * len(spec.table_rows)))

    def flops_per_sample(self, spec: ModelSpec, seq_len: int) -> float:
        return 6.0 * spec.dense_params


DEEPFM = DeepFMFamily()
