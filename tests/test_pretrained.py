"""Fine-tuning from a pretrained Hugging Face folder: the weights read sharded into each strategy's shards
(``strategy.load_pretrained``), against one process's ``from_pretrained``."""

from __future__ import annotations

import pytest
import torch

from conftest import run_dist

from disttrain.parallel.checkpoint.io import CheckpointError, load_pretrained
from disttrain.parallel.checkpoint.pretrained import check_pretrained, stored_names

SPECS = ["disttrain_fsdp", "disttrain_zero3", "disttrain_zero2", "disttrain_megatron:tensor_parallel_size=2"]
MODELS = ["llama", "qwen2", "gemma2", "phi3"]
LORA_SPECS = ["disttrain_ddp", *SPECS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch: each strategy loads each family's bfloat16 folder sharded, then trains 5 steps; then LoRA
    fine-tuning of the Llama folder under each strategy, resumed and exported."""
    return run_dist("pretrained_run.py", tmp_path_factory.mktemp("pretrained"), *SPECS, "--", *MODELS,
                    "--lora", *LORA_SPECS, "--trainer", "disttrain_fsdp")


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("model", MODELS)
def test_fine_tuning_from_a_pretrained_folder_matches_one_process(runs, spec, model):
    result = runs[0][spec][model]
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5)
    # Gemma-2 ties its head to the embedding: the folder holds it once, under the embedding's name
    assert result["tied"] == (["lm_head.weight"] if model == "gemma2" else [])
    # the empty model was initialised as transformers does (std 0.02, the padding row zero), also under zero.Init
    assert 0.015 < result["init_std"] < 0.025
    assert result["pad_row"] in (None, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("spec", LORA_SPECS)
def test_lora_fine_tuning_matches_peft_in_one_process_resumes_and_exports(runs, spec):
    result = runs[0][f"lora {spec}"]
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5)
    # B starts at zero: the first loss is the pretrained model's own (full fine-tuning's first loss, same batch)
    assert result["losses"][0] == pytest.approx(runs[0]["disttrain_fsdp"]["llama"]["losses"][0], rel=1e-6)
    assert result["resumed"] == pytest.approx(result["losses"][3:], rel=1e-6)  # the checkpoint holds the adapters
    # ... and only them (with their optimizer state): the frozen base is read from its folder again on resume
    assert result["checkpoint_model_keys"] and all(".lora_" in k for k in result["checkpoint_model_keys"])
    assert result["checkpoint_model_bytes"] < result["base_bytes"] / 2, result  # fp32 adapters vs the bf16 base
    assert "holds only the parameters that trained" in result["no_base_error"]
    assert "pretrained-llama'; load that folder into the model first" in result["no_base_error"]
    assert "pretrained-llama-changed" in result["other_base_error"]
    assert "whose files differ" in result["other_base_error"]
    assert result["base_unchanged"]  # only the adapters were in the optimizer
    assert result["adapter_logits_err"] < 1e-5  # peft's PeftModel.from_pretrained of the exported adapter folder
    assert result["merged_logits_err"] < 1e-5  # the merged export, into the plain HF model


@pytest.mark.slow
def test_dialogue_module_fine_tunes_a_pretrained_folder_with_lora_under_the_trainer(runs):
    """DialogueLM(pretrained=..., lora=...) under lightning.Trainer: the folder is read sharded in on_fit_start."""
    result = runs[0]["trainer lora disttrain_fsdp"]
    assert result["losses"][0] == pytest.approx(result["base_loss"], rel=1e-4)  # adapters start at B = 0
    assert result["losses"][-1] < result["losses"][0]
    assert result["trainable"] == ["lora_A", "lora_B"]
    assert result["base_equal"]  # the folder's weights, loaded and left frozen
    assert result["lora_B_max"] > 0  # the adapters trained
    assert result["checkpoint_model_keys"] and all(".lora_" in k for k in result["checkpoint_model_keys"])
    assert result["restored_equal"]  # trainer.fit(ckpt_path=...) of a fresh module: the base read again, then these


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


def test_lora_export_merges_like_peft_also_for_gpt2_conv1d_layers(tmp_path):
    """One process, GPT-2 (Conv1D layers store their weight transposed: peft's fan_in_fan_out): the adapter folder
    loads in peft and the merged state equals peft's merge_and_unload."""
    from peft import PeftModel, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from disttrain.parallel.split.lora import LoraSettings, adapter_layers, add_lora, split_export, write_adapter

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32))
    settings = LoraSettings(rank=4, alpha=16, target_modules=["c_attn", "c_proj"])
    model = add_lora(GPT2LMHeadModel(base.config), settings).eval()
    with torch.no_grad():  # base weights as `base`, adapters non-zero (as after training)
        for name, param in model.named_parameters():
            param.copy_(base.state_dict()[name.replace(".base_layer.", ".")] if "lora_" not in name
                        else torch.randn_like(param) * 0.1)
    assert [n for n, p in model.named_parameters() if p.requires_grad] and all(
        "lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    state, layers = model.state_dict(), adapter_layers(model)
    folder = write_adapter(tmp_path / "adapter", split_export(state, layers, merge=False), settings)
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(GPT2LMHeadModel(base.config).eval(), str(folder))
        wrapped = {k.replace(".base_layer.", "."): k for k in state}  # the base weights under peft's names
        loaded.base_model.model.load_state_dict({wrapped.get(k, k): v for k, v in base.state_dict().items()},
                                                strict=False)
        assert torch.allclose(loaded(input_ids=ids).logits, expected, atol=1e-5)
        merged = GPT2LMHeadModel(base.config).eval()
        merged.load_state_dict(split_export(state, layers, merge=True))
        assert torch.allclose(merged(input_ids=ids).logits, expected, atol=1e-5)
    peft_merged = get_peft_model(GPT2LMHeadModel(base.config), settings.peft_config())
    peft_merged.load_state_dict({f"base_model.model.{k}": v for k, v in state.items()}, strict=False)
    unloaded = peft_merged.merge_and_unload().state_dict()
    mine = split_export(state, layers, merge=True)
    assert all(torch.allclose(mine[k], unloaded[k], atol=1e-6) for k in unloaded), "merge differs from peft's"


def test_lora_settings_name_the_bad_value():
    from disttrain.parallel.split.lora import LoraSettings

    with pytest.raises(ValueError, match=r"lora: unknown key\(s\) \['rnak'\]; known:"):
        LoraSettings.from_dict({"rnak": 8})
    with pytest.raises(ValueError, match=r"lora rank=-1 is not a rank"):
        LoraSettings(rank=-1)
    assert LoraSettings.from_dict({"rank": 8, "target_modules": ["q_proj"]}).scaling == 2.0


def test_a_lora_checkpoint_leaves_the_frozen_base_in_its_folder_and_reads_it_back_offline(tmp_path):
    """One process: a checkpoint of a LoRA model filled from a folder holds the adapters only; it loads into a model
    whose base was read from the same folder, is refused without it or with a changed one, and the offline readers
    (exports, load_from_checkpoint) put the base back from the folder."""
    from safetensors.torch import load_file, save_file

    from disttrain.parallel.checkpoint.frozen import FROZEN_KEY, leave_out_frozen_base
    from disttrain.parallel.checkpoint.io import (full_model_state, load_sharded, model_state, read_as_single_file,
                                                  save_sharded)
    from disttrain.parallel.split.lora import LoraSettings, add_lora

    tiny_llama(0).save_pretrained(tmp_path / "base")
    settings = LoraSettings(rank=2, seed=1)

    def lora_model(folder=None):
        model = add_lora(tiny_llama(3), settings)
        if folder is not None:
            load_pretrained(folder, model)
        return model

    trained = lora_model(tmp_path / "base")
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if ".lora_" in name:
                param.add_(0.5)  # as if trained
    tensors, metadata = {"model": model_state(trained)}, {"step": 7}
    leave_out_frozen_base(tensors, metadata, {"model": trained})
    assert tensors["model"] and all(".lora_" in k for k in tensors["model"])
    assert metadata[FROZEN_KEY]["model"]["folder"] == str((tmp_path / "base").resolve())
    save_sharded(tmp_path / "ckpt", tensors, metadata)
    whole = {k: v.clone() for k, v in trained.state_dict().items()}

    with pytest.raises(CheckpointError, match=r"ckpt' holds only the parameters that trained: its \d+ frozen ones are"
                                              r" the pretrained weights of '.*base'; load that folder into the model"):
        load_sharded(tmp_path / "ckpt", {"model": lora_model()}, None)
    changed = tmp_path / "changed"
    changed.mkdir()
    state = load_file(str(tmp_path / "base" / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"] + 1
    save_file(state, str(changed / "model.safetensors"), metadata={"format": "pt"})
    (changed / "config.json").write_text((tmp_path / "base" / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"was trained on the frozen weights of '.*base', but the model's were"
                                              r" read from '.*changed', whose files differ"):
        load_sharded(tmp_path / "ckpt", {"model": lora_model(changed)}, None)

    resumed = lora_model(tmp_path / "base")
    assert load_sharded(tmp_path / "ckpt", {"model": resumed}, None) == {"step": 7}  # no record left for the caller
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in whole.items())

    offline = full_model_state(tmp_path / "ckpt")
    assert offline.keys() == whole.keys() and all(torch.equal(offline[k], v) for k, v in whole.items())
    single = read_as_single_file(tmp_path / "ckpt", key="model")
    assert FROZEN_KEY not in single and all(torch.equal(single["model"][k], v) for k, v in whole.items())
    save_file(state, str(tmp_path / "base" / "model.safetensors"), metadata={"format": "pt"})  # the folder changes
    with pytest.raises(CheckpointError, match=r"frozen weights of '.*base', whose files have changed since"):
        full_model_state(tmp_path / "ckpt")
