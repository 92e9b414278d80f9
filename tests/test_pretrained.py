"""Fine-tuning from a pretrained Hugging Face folder: the weights read sharded into each strategy's shards
(``strategy.load_pretrained``), against one process's ``from_pretrained``."""

from __future__ import annotations

import pytest
import torch

from conftest import run_dist

from disttrain.parallel.checkpoint import CheckpointError, load_pretrained
from disttrain.parallel.pretrained import check_pretrained, stored_names

SPECS = ["disttrain_fsdp", "disttrain_zero3", "disttrain_megatron:tensor_parallel_size=2"]
MODELS = ["llama", "qwen2", "gemma2", "phi3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch: each strategy loads each family's bfloat16 folder sharded, then trains 5 steps."""
    return run_dist("pretrained_run.py", tmp_path_factory.mktemp("pretrained"), *SPECS, "--", *MODELS)


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("model", MODELS)
def test_fine_tuning_from_a_pretrained_folder_matches_one_process(runs, spec, model):
    result = runs[0][spec][model]
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5)
    # Gemma-2 ties its head to the embedding: the folder holds it once, under the embedding's name
    assert result["tied"] == (["lm_head.weight"] if model == "gemma2" else [])


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))


def test_one_process_loads_a_bfloat16_folder_into_float32_and_refuses_another_architecture(tmp_path):
    saved = tiny_llama(0).to(torch.bfloat16)
    saved.save_pretrained(tmp_path / "llama")
    model = tiny_llama(1)
    assert load_pretrained(tmp_path / "llama", model) == []
    for name, tensor in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor.float()), name
    holder = torch.nn.ModuleDict({"model": tiny_llama(1)})  # as a LightningModule holds it: prefix "model."
    load_pretrained(tmp_path / "llama", holder, prefix="model.")
    assert torch.equal(holder["model"].lm_head.weight, saved.lm_head.weight.float())
    from transformers import Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "qwen2")
    with pytest.raises(CheckpointError, match=r"pretrained folder .*qwen2' does not match the model: it has no"
                                              r" \['model.layers.1"):
        load_pretrained(tmp_path / "qwen2", tiny_llama(1))


def test_one_safetensors_file_is_read_alone_and_excluded_names_are_left_as_they_are(tmp_path):
    from safetensors.torch import save_file

    save_file(tiny_llama(2).to(torch.bfloat16).state_dict(), str(tmp_path / "other.safetensors"))  # not read
    saved = {k: v.to(torch.bfloat16) for k, v in tiny_llama(0).state_dict().items()}
    save_file(saved, str(tmp_path / "model.safetensors"))
    model = tiny_llama(1)
    head = model.lm_head.weight.detach().clone()
    assert stored_names(tmp_path / "model.safetensors") == set(saved)
    load_pretrained(tmp_path / "model.safetensors", model, exclude={"lm_head.weight"})
    assert torch.equal(model.lm_head.weight, head)
    assert torch.equal(model.model.embed_tokens.weight, saved["model.embed_tokens.weight"].float())


def test_a_folder_without_safetensors_is_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"pretrained folder .*nothing-here' does not exist; pass a local"):
        check_pretrained(tmp_path / "nothing-here")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"has no \*.safetensors weights \(it holds pytorch_model.bin\);"
                                                r" save them with model.save_pretrained"):
        stored_names(tmp_path / "bin")
    with pytest.raises(FileNotFoundError, match=r"pretrained file .*pytorch_model.bin' is not a \*.safetensors file"):
        check_pretrained(tmp_path / "bin" / "pytorch_model.bin")
