"""Automatic block discovery (the FSDP units) and its override."""

import pytest
import timm
from torch import nn

from common import tiny_llama
from disttrain.parallel import block_candidates
from disttrain.parallel import find_blocks


def test_hf_llama_decoder_layers():
    model = tiny_llama()
    blocks = find_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 2
    assert blocks[0] is model.model.layers[0]


def test_timm_vit_blocks():
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=3, img_size=32, patch_size=8,
                            num_classes=10)
    blocks = find_blocks(vit)
    assert len(blocks) == 3 and all(b is vit.blocks[i] for i, b in enumerate(blocks))


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.stack = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(8, 1)


def test_any_modulelist_of_identical_blocks_outermost_only():
    model = Tower()
    blocks = find_blocks(model)
    assert blocks == list(model.stack)  # not the Linear inside each Sequential


def test_override_by_class_and_by_name():
    model = Tower()
    assert find_blocks(model, nn.Sequential) == list(model.stack)
    assert find_blocks(model, "Linear") == [model.embed, *[s[0] for s in model.stack], model.head]
    assert find_blocks(tiny_llama(), ["LlamaDecoderLayer"])[0].__class__.__name__ == "LlamaDecoderLayer"


def test_unknown_wrap_class_names_the_value_and_the_candidates():
    with pytest.raises(ValueError, match=r"wrap_classes names \['GPT2Block'\] but the model \(LlamaForCausalLM\)"
                                         r" has no module of that class.*LlamaDecoderLayer \(x2\)"):
        find_blocks(tiny_llama(), "GPT2Block")


def test_candidates():
    assert block_candidates(Tower()) == {"Sequential": 3}


class LitGPTShaped(nn.Module):
    """litgpt's GPT layout: the embedding, blocks and final norm inside a ModuleDict (a container with no forward),
    the head beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(16, 8), h=nn.ModuleList(nn.Linear(8, 8) for _ in range(2)),
                                              ln_f=nn.LayerNorm(8)))
        self.lm_head = nn.Linear(8, 16)

    def forward(self, idx):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def test_sub_networks_look_through_containers_without_forward():
    """fully_shard refuses a ModuleDict ("containers that do not implement forward"): its callable parts are the
    units, as litgpt's GPT needs under disttrain_fsdp (its losses then match Lightning's ddp)."""
    from disttrain.parallel.split.fsdp import sub_networks

    model = LitGPTShaped()
    blocks = find_blocks(model)
    assert blocks == list(model.transformer.h)
    units = sub_networks(model, blocks)
    assert units == [model.transformer.wte, model.transformer.ln_f, model.lm_head]


def test_sub_networks_keep_tied_parts_in_the_root():
    from disttrain.parallel.split.fsdp import sub_networks

    model = LitGPTShaped()
    model.lm_head.weight = model.transformer.wte.weight  # tied: both stay in the root unit
    assert sub_networks(model, find_blocks(model)) == [model.transformer.ln_f]
