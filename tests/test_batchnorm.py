"""BatchNorm statistics under the sharded strategies against Lightning's own ``ddp`` (2 CPU ranks, gloo, fp32, the
same data order and seed): a small BatchNorm CNN and a timm ResNet-18 under the Trainer, the CNN under Fabric, and
``sync_batchnorm`` on CPU. One launch per strategy (tests/dist/batchnorm_run.py) serves every distributed test here."""

from __future__ import annotations

import pytest
import torch
from conftest import launch
from torch import nn

from disttrain.parallel.engines.buffers import broadcast_buffers, convert_sync_batchnorm, refuse_sync_batchnorm_on_cpu

pytestmark = pytest.mark.timeout(900)
SHARDED = ["fsdp", "zero3"]
DDP_CPU_REFUSAL = "ValueError: SyncBatchNorm layers only work with GPU modules"


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return launch(tmp_path_factory, "batchnorm_run.py", "ddp")


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return launch(tmp_path_factory, "batchnorm_run.py", "disttrain_fsdp")


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    return launch(tmp_path_factory, "batchnorm_run.py", "disttrain_zero3")


def assert_statistics_match(ranks: list[dict], reference: list[float]) -> None:
    """Every rank holds the same statistics (rank 0's, copied) and they are ddp's."""
    assert ranks[1]["stats"] == ranks[0]["stats"]
    assert torch.allclose(torch.tensor(ranks[0]["stats"]), torch.tensor(reference), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("run", SHARDED)
@pytest.mark.parametrize("case", ["trainer_cnn", "trainer_resnet"])
def test_trainer_statistics_equal_on_every_rank_and_to_ddp(run, case, request, ddp):
    result = request.getfixturevalue(run)
    assert ddp[1][case]["stats"] == ddp[0][case]["stats"]  # ddp's epoch-end validation broadcast rank 0's
    assert_statistics_match([r[case] for r in result], ddp[0][case]["stats"])


@pytest.mark.slow
@pytest.mark.parametrize("run", SHARDED)
@pytest.mark.parametrize("case", ["trainer_cnn", "trainer_resnet"])
def test_trainer_validation_loss_matches_ddp(run, case, request, ddp):
    result = request.getfixturevalue(run)
    assert result[0][case]["global_step"] == 3
    assert result[0][case]["val_loss"] == pytest.approx(ddp[0][case]["val_loss"], rel=1e-4)
    for rank in (0, 1):  # each rank's own batches, evaluated with the same statistics as under ddp
        assert result[rank][case]["rank_val"] == pytest.approx(ddp[rank][case]["rank_val"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("run", SHARDED)
def test_fabric_statistics_and_evaluation_match_ddp(run, request, ddp):
    result = request.getfixturevalue(run)
    assert_statistics_match([r["fabric_cnn"] for r in result], ddp[0]["fabric_cnn"]["stats"])
    for rank in (0, 1):
        assert result[rank]["fabric_cnn"]["eval_loss"] == pytest.approx(ddp[0]["fabric_cnn"]["eval_loss"], rel=1e-4)


@pytest.mark.slow
def test_megatron_keeps_statistics_equal_over_its_data_parallel_ranks(fsdp, ddp):
    assert_statistics_match([r["trainer_cnn_megatron"] for r in fsdp], ddp[0]["trainer_cnn"]["stats"])
    assert fsdp[0]["trainer_cnn_megatron"]["val_loss"] == pytest.approx(ddp[0]["trainer_cnn"]["val_loss"], rel=1e-4)


@pytest.mark.slow
def test_broadcast_buffers_false_lets_each_rank_keep_its_own_statistics(fsdp, ddp):
    own = [r["trainer_cnn_own_buffers"] for r in fsdp]
    assert own[0]["stats"] == pytest.approx(ddp[0]["trainer_cnn"]["stats"], rel=1e-4, abs=1e-6)  # rank 0: its own
    assert own[1]["stats"] != pytest.approx(own[0]["stats"], rel=1e-3)
    assert own[0]["val_loss"] != pytest.approx(ddp[0]["trainer_cnn"]["val_loss"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("run", SHARDED)
@pytest.mark.parametrize("entry", ["trainer_sync_batchnorm", "fabric_sync_batchnorm"])
def test_sync_batchnorm_on_cpu_is_refused_as_ddp_refuses_it(run, entry, request, ddp):
    """Trainer(sync_batchnorm=True) / the Fabric option convert to SyncBatchNorm, which neither ddp nor we run on
    CPU: the same exception and line at setup, then why and what to do."""
    assert ddp[0][entry] == DDP_CPU_REFUSAL  # Fabric: the model converted with torch's convert_sync_batchnorm
    for rank in request.getfixturevalue(run):
        assert rank[entry].startswith(DDP_CPU_REFUSAL + ": disttrain_")
        assert "sync_batchnorm=True" in rank[entry]


@pytest.mark.slow
def test_megatron_applies_the_trainers_sync_batchnorm_too(fsdp):
    for rank in fsdp:
        assert rank["megatron_sync_batchnorm"].startswith(DDP_CPU_REFUSAL + ": disttrain_megatron")


def test_conversion_is_torchs_and_happens_once():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.BatchNorm1d(4 * 2 * 2))
    converted = convert_sync_batchnorm(model)
    assert [type(m) for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)] == \
        [nn.SyncBatchNorm, nn.SyncBatchNorm]
    assert convert_sync_batchnorm(converted) is converted  # an engine may already hook its layers: not again


def test_sync_batchnorm_is_refused_on_cpu_only():
    synced = convert_sync_batchnorm(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    with pytest.raises(ValueError, match="^SyncBatchNorm layers only work with GPU modules: disttrain_fsdp"):
        refuse_sync_batchnorm_on_cpu(synced, torch.device("cpu"), "disttrain_fsdp")
    refuse_sync_batchnorm_on_cpu(synced, torch.device("cuda", 0), "disttrain_fsdp")
    refuse_sync_batchnorm_on_cpu(nn.BatchNorm1d(2), torch.device("cpu"), "disttrain_fsdp")  # plain BatchNorm runs


def test_broadcast_is_a_no_op_in_one_process():
    bn = nn.BatchNorm1d(2)
    bn.running_mean.fill_(3.0)
    broadcast_buffers(bn)
    assert bn.running_mean.tolist() == [3.0, 3.0]
