"""The int8 gradient codec of disttrain.parallel.split.compress in one process (the collectives are tested on 2 ranks in
test_distributed.py): rounding within half a step of each chunk's scale, the wire format, and error feedback."""

from __future__ import annotations

import torch

from disttrain.parallel.split.compress import BLOCK, dequantize, pack, quantize, unpack


def test_quantize_rounds_each_chunk_within_half_its_step():
    x = torch.randn(3, 4 * BLOCK) * torch.tensor([1e-4, 1.0, 1e3]).repeat_interleave(BLOCK * 4 // 3 + 1)[:4 * BLOCK]
    values, scales = quantize(x)
    assert values.dtype == torch.int8 and values.shape == (3, 4, BLOCK) and scales.shape == (3, 4)
    error = (dequantize(values, scales) - x).abs().unflatten(-1, (4, BLOCK))
    assert (error <= scales.unsqueeze(-1) / 2 * (1 + 1e-5)).all()  # small chunks keep their own fine step
    assert values.abs().amax(-1).eq(127).all()  # each chunk's largest value uses the full range


def test_pack_is_one_int8_tensor_that_unpacks_exactly():
    values, scales = quantize(torch.randn(2, 3 * BLOCK))
    payload = pack(values, scales)
    assert payload.dtype == torch.int8 and payload.shape == (2, 3 * (BLOCK + 4))
    got_values, got_scales = unpack(payload)
    assert torch.equal(got_values, values) and torch.equal(got_scales, scales)


def test_error_feedback_loses_nothing_over_steps():
    """What the codec sends over many steps sums to what it was given, but for the last residual (<= half a step)."""
    torch.manual_seed(0)
    residual, given, sent = torch.zeros(BLOCK), torch.zeros(BLOCK), torch.zeros(BLOCK)
    for _ in range(50):
        grad = torch.randn(BLOCK) * 1e-3
        grad[0] = 1.0  # an outlier: the rest of the chunk rounds to 0 or +-1 step every time
        compensated = grad + residual
        values, scales = quantize(compensated)
        residual = compensated - dequantize(values, scales)
        given, sent = given + grad, sent + dequantize(values, scales)
    assert torch.allclose(sent + residual, given, atol=1e-5)
    assert (residual.abs() <= 1.0 / 127).all()
