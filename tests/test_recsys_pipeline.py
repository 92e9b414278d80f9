"""disttrain_recsys with torchrec's sparse-dist pipeline and quantized comms codecs, on 2 CPU processes, each against
the plain loop on the same batches in the same processes (tests/dist/recsys_pipeline.py)."""

from __future__ import annotations

import pytest

from conftest import run_dist

from disttrain.parallel.engines.recsys import RecsysOptions


def test_options_refuse_unknown_values_in_one_line():
    with pytest.raises(ValueError, match=r"pipeline='sparse' is not a training pipeline; choose one of sparse_dist"):
        RecsysOptions(pipeline="sparse")
    with pytest.raises(ValueError, match=r"comm_precision='int4' .* choose one of fp32, fp16, bf16, fp8"):
        RecsysOptions(comm_precision="int4")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_dist("recsys_pipeline.py", tmp_path_factory.mktemp("recsys_pipeline"))


@pytest.mark.slow
def test_pipeline_gives_the_plain_loops_losses_and_weights_bitwise(runs):
    for rank in runs:
        plain, piped = rank["trainer_losses"]
        assert plain == piped and len(plain) == rank["steps"][1] == 10  # Trainer: every step, bit for bit
        assert rank["trainer_state_diff"] == 0.0  # dense weights and this rank's table shards
        assert rank["trainer_after_diff"] == 0.0  # after fit the tables have their own forward back
        assert rank["val_losses"][0] == rank["val_losses"][1] and rank["val_state_diff"] == 0.0  # validation mid-epoch
        fabric_plain, fabric_piped, fabric_none = rank["fabric_losses"]
        assert fabric_plain == fabric_piped == fabric_none  # Fabric: train_pipeline against a hand-written loop
        assert rank["fabric_state_diff"] == rank["fabric_none_diff"] == 0.0
        # Throughput keeps reporting under the pipeline, with the tables' traffic per step
        assert rank["metrics"]["throughput/samples_per_s"] > 0 and rank["metrics"]["comm/table_bytes_per_step"] > 0


@pytest.mark.slow
def test_half_precision_codecs_halve_the_embedding_bytes_and_keep_the_losses(runs):
    for rank in runs:
        fp32 = rank["table"]["fp32"]
        for precision in ("fp16", "bf16"):
            sent = rank["table"][precision]
            assert sent["embeddings"] <= 0.5 * fp32["embeddings"] and sent["embeddings"] > 0, (precision, sent, fp32)
            assert sent["ids"] == fp32["ids"]  # ids and lengths are not quantized
            # 10 steps: each loss within 0.1% of fp32's with fp16 (11 bits of mantissa; 4e-5 seen) and 3% with
            # bf16 (8 bits; 1.0% seen): the rounding of the looked-up embeddings and their gradients, compounded
            bound = {"fp16": 1e-3, "bf16": 3e-2}[precision]
            for ours, reference in zip(rank["codec_losses"][precision], rank["codec_losses"]["fp32"]):
                assert abs(ours - reference) <= bound * reference, (precision, ours, reference)
        assert rank["fp8"].startswith("comm_precision='fp8' needs CUDA")
