"""Context parallelism (disttrain.parallel.split.cp) on CPU with gloo: the losses of 5 AdamW steps, the step-1 gradients
(after FSDP's or an averaging reduction over the cp ranks) and an evaluation forward equal one process's, on packed
rows, for Llama (eager, sdpa), Qwen2 and Mistral (sliding windows), at cp=2 and cp=4, under FSDP2 with activation
checkpointing, data x cp, and cp x tensor parallel; and the one-line refusals.

Two launches (tests/dist/cp_core.py, several cases each); the references are computed in the same runs."""

from __future__ import annotations

import pytest
from conftest import run_dist

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOLERANCE = 1e-5  # fp32 on CPU
# cp=2: Llama (sdpa at 2048 tokens, and under FSDP with activation checkpointing), Qwen2, Mistral's sliding window;
# cp=4 (kv heads repeated): Llama (eager), Qwen2; the 2 x 2 meshes: data x cp under FSDP, cp x tensor parallel.
TWO = ["llama_sdpa_2048", "qwen2_sdpa", "mistral_sliding", "fsdp_ac"]
FOUR = ["llama_eager", "qwen2_sdpa", "dp_cp", "cp_tp"]
LENGTHS = {"llama_sdpa_2048": 2048}
BATCH, VOCAB = 2, 128


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    return run_dist("cp_core.py", tmp_path_factory.mktemp("cp_core_2"), *TWO, "refusals", "layout", nproc=2)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    return run_dist("cp_core.py", tmp_path_factory.mktemp("cp_core_4"), *FOUR, nproc=4)


def compared(ranks: list[dict], case: str) -> dict:
    """The result of the rank that computed the case's one-process reference."""
    return next(r[case] for r in ranks if "loss_error" in r[case])


@pytest.mark.parametrize("launch, case", [("two", c) for c in TWO] + [("four", c) for c in FOUR])
def test_parity_with_one_process(launch, case, request):
    ranks = request.getfixturevalue(launch)
    result = compared(ranks, case)
    assert result["loss_error"] <= TOLERANCE, result
    assert result["grad_error"]["max"] <= TOLERANCE, result["grad_error"]
    assert result["eval_loss_error"] <= TOLERANCE and result["eval_logits_error"] <= TOLERANCE, result
    length = LENGTHS.get(case, 1024)
    # Training and evaluation: this rank's T/cp tokens only; gathered, the whole sequence.
    assert result["logits_shape"] == [BATCH, length, VOCAB]
    assert result["train_logits_shape"] == result["eval_logits_shape"] == [BATCH, length // result["cp"], VOCAB]
    assert result["attached"]
    # Every cp rank of a batch returns the one-process loss of that batch (its dp group's).
    by_dp = {}
    for rank in ranks:
        by_dp.setdefault(rank[case]["dp_rank"], set()).add(tuple(rank[case]["losses"]))
    assert all(len(losses) == 1 for losses in by_dp.values()), by_dp


def test_masks_matter(two, four):
    """The packing and the sliding window change the loss far beyond the tolerance, so the parity above covers them."""
    llama, mistral = compared(four, "llama_eager"), compared(two, "mistral_sliding")
    assert abs(llama["unpacked_loss"] - llama["eval_loss"]) / llama["eval_loss"] > 1e-3
    assert abs(mistral["windowless_loss"] - mistral["eval_loss"]) / mistral["eval_loss"] > 1e-3


def test_refusals_are_one_line_and_name_the_fix(two):
    for rank in two:
        errors = {k: v for k, v in rank["refusals"].items() if k != "seconds"}
        assert errors.pop("all_ones_mask_ok") == "no error"
        for name, message in errors.items():
            assert message != "no error" and "\n" not in message, (name, message)
        assert "T=1001" in errors["length"] and "cp=2" in errors["length"] and "multiple of 2" in errors["length"]
        assert "num_attention_heads=3" in errors["heads"] and "cp=2" in errors["heads"] and "[1, 3]" in errors["heads"]
        assert "cpu" in errors["ring_cpu"] and "attention='all_to_all'" in errors["ring_cpu"]
        assert "attention_mask" in errors["padding"] and "pack" in errors["padding"]
        assert "GPT2LMHeadModel" in errors["family"] and "activation_checkpointing=True" in errors["family"]
        assert "did you mean 'all_to_all'" in errors["typo"]
        assert "already applied" in errors["twice"]
        assert "changed to 'eager'" in errors["attention_changed"]


def test_local_tokens_and_gather(two):
    """all_to_all: rank r holds the r-th contiguous slice; ring: torch's head-tail chunks r and 2*cp-1-r, the ones
    torch's own sharding of the ring's inputs gives it. Gathering the local parts gives the natural order back."""
    for rank, result in enumerate(two):
        layout = result["layout"]
        assert layout["all_to_all"]["local"] == list(range(8 * rank, 8 * rank + 8))
        chunks = [rank, 2 * 2 - 1 - rank]
        assert layout["ring"]["local"] == [4 * c + i for c in chunks for i in range(4)]
        assert layout["all_to_all"]["round_trip"] and layout["ring"]["round_trip"]
        assert layout["ring"]["shards_match_local"]
        assert "packed rows" in layout["ring"]["packed"] and "attention='all_to_all'" in layout["ring"]["packed"]
