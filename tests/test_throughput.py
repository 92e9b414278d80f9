"""The Throughput callback: FLOPs and MFU arithmetic against hand-computed numbers, the HF config helper, the peak
table, a real Trainer fit and a Fabric loop on CPU, clear errors, and the global rate over 2 ranks."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import run_dist
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.loggers import Logger
from torch import nn

from common import SEQ, VOCAB, LlamaModule, loader, tiny_llama
from disttrain.callbacks.throughput import (
    Throughput,
    TransformerDims,
    hf_transformer_dims,
    measure_train_flops,
    mfu,
    peak_flops_per_device,
    peak_table_name,
    transformer_flops_per_token,
)


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call: (step, metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict]] = []

    name, version = "memory", 0

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def test_mfu_matches_a_hand_computed_case():
    # A 1B model, 16 layers, hidden 2048, sequences of 2048 tokens; 1e5 tokens/s on 8 A100s (312 TFLOP/s bf16).
    # 6N = 6e9; attention 12 * 16 * 2048 * 2048 = 805,306,368; per token 6,805,306,368 FLOPs.
    per_token = transformer_flops_per_token(n_params=1_000_000_000, n_layers=16, hidden=2048, seq_len=2048)
    assert per_token == 6_805_306_368
    # Causal: half the attention scores, 6e9 + 402,653,184.
    assert transformer_flops_per_token(1_000_000_000, 16, 2048, 2048, causal=True) == 6_402_653_184
    # 1e5 tokens/s -> 6.805306368e14 FLOP/s for the job, 8.50663296e13 per device, / 312e12 = 0.27264849...
    assert mfu(1e5 * per_token, n_devices=8, peak_flops=312e12) == pytest.approx(0.272648492, rel=1e-8)
    assert 8.50663296e13 / 312e12 == pytest.approx(0.272648492, rel=1e-8)


def test_flops_formula_equals_torch_flop_counter_on_tiny_llama():
    # torch's FlopCounter counts matmuls only: with the matrix parameters as N (the norm weights are elementwise)
    # and eager attention (the full score matrix), 6N + 12 L H S per token is exact.
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    counted = measure_flops(model, lambda: model(input_ids=ids).logits, lambda y: y.sum())
    embedding = model.get_input_embeddings().weight
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p is not embedding)
    assert counted == transformer_flops_per_token(matrices, n_layers=2, hidden=64, seq_len=SEQ) * ids.numel()


def test_hf_dims_of_tiny_llama_from_config_and_from_model():
    # Per layer: q 64x64, k and v 64x32 (2 kv heads x 16), o 64x64, gate/up/down 3 x 64x128, 2 norms of 64:
    # 36,992; x2 layers + final norm 64 + lm_head 96x64 = 80,192. The input embedding (a lookup) is left out.
    model = tiny_llama()
    expected = TransformerDims(n_params=80_192, n_layers=2, hidden=64)
    assert hf_transformer_dims(model.config) == expected
    assert hf_transformer_dims(model) == expected
    assert expected.n_params == sum(p.numel() for p in model.parameters()) - VOCAB * 64


def test_measure_train_flops_on_the_meta_device():
    # Batch 8, Linear(32, 64) -> ReLU -> Linear(64, 10): forward 2*8*(32*64 + 64*10) = 43,008; backward: both
    # weight gradients (2*8*2048 + 2*8*640 = 43,008) but only the second layer's input gradient (10,240): the
    # network's input needs none. Total 96,256.
    flops = measure_train_flops(lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)),
                                lambda m: m(torch.randn(8, 32)))
    assert flops == 96_256


def test_peak_table():
    assert peak_flops_per_device("a100", "bf16") == 312e12
    assert peak_flops_per_device("NVIDIA H200", "bf16") == 989.4e12
    assert peak_flops_per_device("Tesla T4", "fp16") == 65e12
    assert peak_flops_per_device("Tesla V100-SXM2-16GB", "tf32") == 15.7e12  # no TF32 before Ampere
    assert peak_table_name("NVIDIA H100 80GB HBM3") == "h100 sxm"
    assert peak_table_name("NVIDIA H100 PCIe") == "h100 pcie"
    assert peak_table_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert peak_table_name("NVIDIA L40S") is None  # not an L4


@pytest.mark.parametrize("kwargs,message", [
    ({"peak_flops": 0}, r"peak_flops=0 must be the positive peak FLOP/s of one device, e\.g\. peak_flops=312e12"),
    ({"peak_flops": -1e12}, r"peak_flops=-1000000000000\.0 must be the positive"),
    ({"peak_flops": "a1000"}, (r"peak_flops='a1000' is not a device of the peak table \(known: a100, .*\); pass "
                               r"the peak FLOP/s of one device as a number instead")),
    ({"window_size": 1}, r"window_size=1 must be at least 2"),
    ({"every_n_steps": 0}, r"every_n_steps=0 must be at least 1"),
    ({"flops_per_batch": 1e9, "transformer": TransformerDims(1, 1, 1)}, r"either transformer= .* or flops_per_batch="),
])
def test_bad_arguments_name_the_value_and_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Throughput(**kwargs)


def test_a_dtype_the_device_lacks_is_an_error():
    with pytest.raises(ValueError, match=r"'t4' \(t4\) has no bf16 peak in the table \(it has fp32, fp16\)"):
        peak_flops_per_device("t4", "bf16")


@pytest.mark.parametrize("peak,accumulate", [(None, 1), (2e12, 2)], ids=["no_peak", "peak_accumulate_validate"])
def test_trainer_fit_reports_throughput_memory_and_mfu(peak, accumulate):
    tp = Throughput(every_n_steps=2, peak_flops=peak)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[tp],
                        accumulate_grad_batches=accumulate, limit_val_batches=2)
    # With accumulation, 8 micro-batches over 6 per epoch: the end-of-epoch validation falls inside the run.
    trainer.fit(LlamaModule(), loader(), loader() if accumulate > 1 else None)
    assert ("val_loss" in trainer.callback_metrics) == (accumulate > 1)
    m = tp.metrics
    assert m["throughput/tokens_per_s"] > 0
    assert m["throughput/samples_per_s"] == pytest.approx(m["throughput/tokens_per_s"] / SEQ)
    # An optimizer step is `accumulate` micro-batches of 2 sequences.
    assert m["throughput/samples_per_s"] == pytest.approx(2 * accumulate * m["throughput/steps_per_s"])
    assert m["memory/peak_mib"] > 0 and m["memory/peak_mib_rank0"] == m["memory/peak_mib"]
    # FLOPs found from the HF model inside the LightningModule: 6N + 12 L H S per token.
    per_token = transformer_flops_per_token(80_192, 2, 64, SEQ)
    assert m["throughput/tflops_per_device"] * 1e12 == pytest.approx(m["throughput/tokens_per_s"] * per_token)
    if peak is None:  # CPU: the peak is unknown, so no MFU
        assert "throughput/mfu" not in m
    else:
        assert m["throughput/mfu"] == pytest.approx(m["throughput/tflops_per_device"] * 1e12 / peak)


def test_fabric_loop_logs_every_n_steps():
    logger = MemoryLogger()
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[logger])
    model = tiny_llama()
    tp = Throughput(transformer=model.config, every_n_steps=3, peak_flops="a100")  # a name: read in fp32 here
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    reports = []
    for (ids,) in loader():
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        reports.append(tp.step(fabric, {"input_ids": ids}))
    assert [bool(r) for r in reports] == [False, False, True, False, False, True]
    assert [step for step, _ in logger.calls] == [3, 6]
    assert logger.calls[-1][1] == tp.metrics == reports[-1]
    m = tp.metrics
    assert m["throughput/tokens_per_s"] > 0 and m["memory/peak_mib"] > 0
    per_token = transformer_flops_per_token(80_192, 2, 64, SEQ)
    assert m["throughput/mfu"] == pytest.approx(m["throughput/tokens_per_s"] * per_token / 19.5e12)


def test_fabric_flops_per_batch_for_a_model_without_tokens():
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    tp = Throughput(every_n_steps=4, peak_flops=1e11,
                    flops_per_batch=lambda: measure_train_flops(lambda: nn.Sequential(
                        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)), lambda m: m(torch.randn(8, 32))))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    for _ in range(4):
        x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        tp.step(fabric, (x, y))
    m = tp.metrics
    assert "throughput/tokens_per_s" not in m  # float inputs: samples, not tokens
    assert m["throughput/samples_per_s"] == pytest.approx(8 * m["throughput/steps_per_s"])
    assert m["throughput/tflops_per_device"] * 1e12 == pytest.approx(96_256 * m["throughput/steps_per_s"])
    assert m["throughput/mfu"] == pytest.approx(m["throughput/tflops_per_device"] * 1e12 / 1e11)


def test_a_batch_without_tokens_for_a_transformer_is_an_error():
    fabric = L.Fabric(accelerator="cpu", devices=1)
    tp = Throughput(transformer=TransformerDims(1000, 2, 64))
    with pytest.raises(ValueError, match=r"cannot count the tokens and sequence length of a Tensor batch; pass "
                                         r"tokens_per_batch=<function of the batch> and seq_len=<int>"):
        tp.step(fabric, torch.randn(4, 16))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_global_rate_is_the_sum_of_both(tmp_path):
    ranks = run_dist("throughput_run.py", tmp_path)
    # Rank r trained on r+1 sequences per step, so the ranks' rates differ; the job's rate is their sum.
    assert [r["tokens"] for r in ranks] == [4 * 1 * SEQ, 4 * 2 * SEQ]
    m = ranks[0]["metrics"]
    assert ranks[1]["metrics"] == m  # every rank gets the same report
    assert m["throughput/tokens_per_s"] == pytest.approx(sum(r["local_tokens_per_s"] for r in ranks))
    assert m["throughput/tokens_per_s_per_device"] == pytest.approx(m["throughput/tokens_per_s"] / 2)
    job_flops = sum(r["local_flops_per_s"] for r in ranks)
    assert m["throughput/mfu"] == pytest.approx(job_flops / 2 / 1e12)
    assert m["memory/peak_mib_rank0"] > 0 and m["memory/peak_mib_rank1"] > 0
    assert m["memory/peak_mib"] == max(m["memory/peak_mib_rank0"], m["memory/peak_mib_rank1"])
