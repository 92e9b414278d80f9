"""The planner's per-rank memory estimate against memory measured under each registered strategy (2 CPU processes,
gloo): model states from the tensors each rank holds, activations from the tensors autograd saved for backward.
The target is 15%; the assertion allows 25% to stay robust. ``bench/planner_accuracy.py`` prints the errors."""

import pytest
from conftest import run_dist

MEASURED = ["disttrain_ddp", "disttrain_fsdp", "disttrain_fsdp_offload", "disttrain_zero3", "disttrain_zero3_offload",
            "disttrain_megatron:tensor_parallel_size=2", "disttrain_megatron:pipeline_parallel_size=2,microbatches=2",
            "disttrain_megatron:context_parallel_size=2"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", MEASURED)
def test_estimate_matches_measurement(tmp_path, strategy):
    ranks = run_dist("planner_measure.py", tmp_path, strategy)  # a tiny and a small Llama, in one launch
    for size, rank in ((size, r[size]) for r in ranks for size in ("tiny", "small")):
        measured, predicted = rank["measured"], rank["estimate"]
        for key in ("states", "activations"):
            error = abs(predicted[key] - measured[key]) / measured[key]
            assert error < 0.25, f"{strategy} {size} {key}: estimate {predicted[key]} vs measured {measured[key]}"
        total_error = abs(predicted["states"] + predicted["activations"] - measured["states"]
                          - measured["activations"]) / (measured["states"] + measured["activations"])
        assert total_error < 0.25


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["disttrain_fsdp", "disttrain_megatron:tensor_parallel_size=2"])
def test_measured_estimate_of_a_model_outside_the_formulas(tmp_path, strategy):
    """GPT-2 has no analytic formula: its estimate comes from its forward run on the meta device (and under tensor
    parallelism from which saved tensors fall between its column- and row-wise layers). Checked against what each
    rank really holds and saves."""
    for rank in run_dist("planner_measure.py", tmp_path, strategy, "gpt2"):
        measured, predicted = rank["gpt2"]["measured"], rank["gpt2"]["estimate"]
        for key in ("states", "activations"):
            error = abs(predicted[key] - measured[key]) / measured[key]
            assert error < 0.15, f"{strategy} gpt2 {key}: estimate {predicted[key]} vs measured {measured[key]}"
