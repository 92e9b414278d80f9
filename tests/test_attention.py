"""FlashAttention callback and apply_fast_attention: switched layers give the eager outputs, on CPU."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from common import VOCAB, tiny_llama
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from disttrain.callbacks.attention import FlashAttention, apply_fast_attention, flash_attn_2_missing, format_report


def test_hf_llama_eager_to_sdpa_gives_equal_logits():
    model = tiny_llama().eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        report = apply_fast_attention(model)
        fast = model(input_ids=ids).logits
    assert report == {f"model.layers.{i}.self_attn": "sdpa" for i in range(2)}
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(fast, eager, atol=1e-5, rtol=1e-5)
    assert "2 attention layer(s)" in format_report(report)


def test_hf_model_inside_a_wrapper_is_found_and_named_from_the_wrapper():
    wrapper = nn.ModuleDict({"lm": tiny_llama()})
    report = apply_fast_attention(wrapper)
    assert sorted(report) == ["lm.model.layers.0.self_attn", "lm.model.layers.1.self_attn"]
    assert set(report.values()) == {"sdpa"}


def test_an_hf_implementation_chosen_on_purpose_is_kept():
    model = tiny_llama()
    model.config._attn_implementation_internal = "flex_attention"  # what set_attn_implementation would store
    assert set(apply_fast_attention(model).values()) == {"flex_attention"}


def test_timm_vit_fused_attn_gives_equal_outputs():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2, img_size=32, patch_size=8,
                              num_classes=10).eval()
    attns = [m for m in model.modules() if hasattr(m, "fused_attn")]
    for m in attns:
        m.fused_attn = False
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        eager = model(x)
        report = apply_fast_attention(model)
        fast = model(x)
    assert all(m.fused_attn for m in attns)
    assert report == {"blocks.0.attn": "sdpa", "blocks.1.attn": "sdpa"}
    torch.testing.assert_close(fast, eager, atol=1e-5, rtol=1e-5)


class ProtocolAttention(nn.Module):
    """Our own attention module: the ``use_sdpa`` flag protocol (SDPA when True, eager when False)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.use_sdpa = heads, False
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # (B, H, T, D)
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            y = scores.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def test_custom_module_following_the_protocol():
    torch.manual_seed(0)
    model = nn.Sequential(ProtocolAttention(), nn.GELU(), ProtocolAttention())
    x = torch.randn(2, 10, 32)
    eager = model(x)
    report = apply_fast_attention(model)
    assert report == {"0": "sdpa", "2": "sdpa"}
    torch.testing.assert_close(model(x), eager, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(flash_attn_2_missing() is None, reason="flash-attn can run here")
def test_require_without_flash_attn_names_what_is_missing():
    with pytest.raises(RuntimeError, match=r"(?s)FlashAttention-2 is not available because .*pip install flash-attn"):
        apply_fast_attention(tiny_llama(), require=True, device="cpu")
    with pytest.raises(RuntimeError, match="require=True"):
        L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[FlashAttention(require=True)]).fit(LlamaModule(False), _loader())


class LlamaModule(L.LightningModule):
    def __init__(self, build_in_configure: bool) -> None:
        super().__init__()
        self.model = None if build_in_configure else tiny_llama()
        self.seen: list[str] = []  # the attention implementation each training step ran with

    def configure_model(self) -> None:
        if self.model is None:
            self.model = tiny_llama()

    def training_step(self, batch, batch_idx):
        self.seen.append(self.model.config._attn_implementation)
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (4, 16))), batch_size=2)


@pytest.mark.parametrize("build_in_configure", [False, True], ids=["built_in_init", "built_in_configure_model"])
def test_callback_switches_through_a_trainer_fit(build_in_configure, caplog):
    callback = FlashAttention()
    module = LlamaModule(build_in_configure)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(module, _loader())
    assert callback.report == {f"model.model.layers.{i}.self_attn": "sdpa" for i in range(2)}
    assert module.seen == ["sdpa", "sdpa"]
    printed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("FlashAttention:")]
    assert len(printed) == 1 and "2 attention layer(s)" in printed[0]  # once, although applied at setup and start


def test_flash_attn_missing_names_the_reason(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn"
                        else real_find_spec(name, *a))
    assert flash_attn_2_missing("cpu") == "the flash-attn package is not installed"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn"
                        else real_find_spec(name, *a))
    assert "only has CUDA kernels" in flash_attn_2_missing("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or flash_attn_2_missing("cuda") is not None,
                    reason="needs flash-attn and a CUDA GPU of compute capability >= 8.0")
def test_flash_attn_package_is_preferred_on_a_supported_gpu():
    model = tiny_llama().to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, VOCAB, (2, 16), device="cuda")
    with torch.no_grad():
        eager = model(input_ids=ids).logits.float()
        report = apply_fast_attention(model, require=True, device="cuda")
        fast = model(input_ids=ids).logits.float()
    assert set(report.values()) == {"flash_attention_2"}
    torch.testing.assert_close(fast, eager, atol=2e-2, rtol=2e-2)  # bf16
