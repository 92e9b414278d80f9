"""``disttrain_megatron`` on Hugging Face models through the plans their configs declare (no disttrain family file),
and timm models beyond VisionTransformer: against one process, or refused in one line."""

from __future__ import annotations

import re

import pytest
from conftest import run_dist
from test_megatron import REL, check_family, megatron

# Checked whole (losses, full state, DCP checkpoint, HF export, resumed step) under each layout; every other family
# with a declared plan: test_every_declared_hf_tp_plan_...; MoE experts: test_moe.py.
MODELS = {"tp": ["phi3", "neox", "gemma2", "qwen2-moe", "deit", "eva02"],
          "pp": ["gemma2", "gemma2-untied", "phi3", "qwen2-moe", "deit", "eva02"]}
EVA = "timm Eva is not split: EVA-02's blocks apply rotary embeddings .* train it with disttrain_fsdp or"
REFUSED = {"tp": {"eva02": EVA},
           "pp": {"eva02": EVA,
                  "deit": "does not split VisionTransformerDistilled \\(DeiT's distillation token and second head\\)"}}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Each model trained 2 steps under tp=2 and under pp=2 (2 processes each), next to one process."""
    specs = {"tp": megatron(tensor_parallel_size=2), "pp": megatron(pipeline_parallel_size=2, microbatches=2)}
    return {layout: run_dist("families_run.py", tmp_path_factory.mktemp(f"hf_plans_{layout}"), spec,
                             *MODELS[layout])[0] for layout, spec in specs.items()}


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "model"), [(layout, m) for layout, models in MODELS.items() for m in models])
def test_declared_plans_match_one_process_and_export_their_own_layout(families, layout, model):
    check_family(families[layout][model], layout, model, REFUSED)


# -- every HF causal-LM family whose config declares a tensor-parallel plan ----------------------------------------
@pytest.mark.slow
def test_every_declared_hf_tp_plan_matches_one_process_or_is_refused(tmp_path):
    """tp=2 against one process on a tiny config of each causal-LM family of the pinned transformers whose config
    declares base_model_tp_plan (2 SGD steps). A family whose tiny config does not run on one CPU process is not a
    disttrain matter and is only counted."""
    result = run_dist("hf_tp_plans.py", tmp_path)[0]
    matched = [t for t, r in result.items() if "losses" in r and r["losses"] == pytest.approx(r["ref_losses"], rel=REL)]
    refused = {t: r["refused"] for t, r in result.items() if "refused" in r}
    skipped = [t for t, r in result.items() if "skipped" in r]
    assert len(result) == 119  # transformers 5.25: causal LMs with a declared tensor-parallel plan
    assert sorted(matched + list(refused) + skipped) == sorted(result), {
        t: r for t, r in result.items() if t not in matched and t not in refused and t not in skipped}
    assert all(re.match(r"tensor parallelism does not split \w+ with the plan its config declares: .*; use"
                        r" disttrain_fsdp", line) for line in refused.values()), refused
    assert len(matched) >= 85 and len(refused) <= 3, (len(matched), refused, {
        t: r for t, r in result.items() if "losses" in r and t not in matched})
