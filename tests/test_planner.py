"""The planner on one process: structure read from configs (checked against models built on the meta device),
memory arithmetic, the three reference cases (docs/choosing.md), bad input, and `disttrain plan`."""

import math
from pathlib import Path

import pytest
import torch
import yaml

from conftest import run_python
from disttrain.planner import (
    Hardware,
    choose,
    estimate,
    hardware,
    model_spec,
    parse_bytes,
    table_placement,
)
from disttrain.planner.choose import TIE
from disttrain.planner.spec import meta_model

ROOT = Path(__file__).resolve().parents[1]

# The three industrial cases' `model:` mappings (the recipes' YAML files carry the same keys).
DIALOGUE_10B = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 48,
                "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 2048,
                "tie_word_embeddings": False}
VIT_2B = {"img_size": 224, "patch_size": 14, "in_chans": 3, "num_classes": 1000, "embed_dim": 1792, "depth": 48,
          "num_heads": 16, "mlp_ratio": 4.5}
DEEPFM_5B = {"embedding_dim": 128, "dense_in_features": 13, "bottom_mlp": [512, 256, 128], "deep_mlp": [1024, 1024, 512],
             "num_embeddings_per_feature": [2_500_000] * 10 + [1_300_000] * 10 + [120_000] * 6}
TINY_LLAMA = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


@pytest.mark.parametrize("config", [TINY_LLAMA, dict(TINY_LLAMA, tie_word_embeddings=True, attention_bias=True),
                                    {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 4,
                                     "num_classes": 10}, VIT_2B, DIALOGUE_10B])
def test_parameter_count_matches_meta_model(config):
    model = meta_model(config)  # the meta device: even the 10B model allocates nothing
    assert model_spec(config).params == sum(p.numel() for p in model.parameters())
    assert model_spec(model).params == model_spec(config).params


def test_case_sizes():
    assert 9.5e9 < model_spec(DIALOGUE_10B).params < 10.5e9
    assert 1.9e9 < model_spec(VIT_2B).params < 2.1e9
    spec = model_spec(DEEPFM_5B)
    assert 4.8e9 < spec.params < 5.2e9 and spec.table_params / spec.params > 0.99


def test_yaml_and_recipe_dict(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": DIALOGUE_10B, "train": {"lr": 1e-4}}))
    assert model_spec(path) == model_spec(DIALOGUE_10B) == model_spec({"model": DIALOGUE_10B})


def test_state_arithmetic():
    P = model_spec(DIALOGUE_10B).params
    ddp = estimate(DIALOGUE_10B, "disttrain_ddp", 8, precision="bf16-mixed")
    assert ddp.states == 16 * P  # fp32 params, grads, two Adam moments
    fsdp = estimate(DIALOGUE_10B, "disttrain_fsdp", 8)
    assert fsdp.states == pytest.approx(16 * P / 8, rel=1e-6)
    off = estimate(DIALOGUE_10B, "disttrain_zero3_offload", 8)
    assert off.strategy == "disttrain_zero3_offload" and off.states == 0 and off.host == pytest.approx(2 * P, rel=1e-6)
    tp = estimate(DIALOGUE_10B, "disttrain_megatron", 8, tensor_parallel_size=8)
    assert tp.activations < fsdp.activations / 3  # heads and MLP split 8 ways; norms stay replicated
    ac = estimate(DIALOGUE_10B, "disttrain_fsdp", 8, activation_checkpointing=True)
    assert ac.activations < fsdp.activations / 5
    eager = estimate(dict(DIALOGUE_10B, attn_implementation="eager"), "disttrain_fsdp", 8)
    assert eager.activations > fsdp.activations  # eager attention keeps the a x s x s softmax


def test_activation_formula_against_saved_tensors():
    """The per-token coefficients against what autograd saves in a real forward of transformers' Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from disttrain.planner import activation_bytes
    from disttrain.planner.measure import SavedActivations

    for attn in ("sdpa", "eager"):
        config = dict(TINY_LLAMA, hidden_size=128, num_attention_heads=8, attn_implementation=attn)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**config, use_cache=False))
        ids = torch.randint(0, 96, (3, 24))
        with SavedActivations(model) as saved:
            model(input_ids=ids, labels=ids).loss
        predicted = activation_bytes(model_spec(config), 3, 24, 4)
        assert abs(predicted - saved.bytes()) / saved.bytes() < 0.05, (attn, predicted, saved.bytes())


def test_table_wise_placement_balances():
    rows = (10, 9, 8, 1, 1, 1)
    placement = table_placement(rows, 2)
    assert sorted(i for r in placement for i in r) == list(range(6))  # every table on exactly one rank
    assert sorted(sum(rows[i] for i in r) for r in placement) == [13, 17]  # largest first, onto the lightest


def fastest(plan):
    """The choice is the highest estimated throughput that fits, up to the 3% tie the simpler set-up wins."""
    best = plan.ranked()[0]
    return plan.choice.samples_per_s >= best.samples_per_s / (1 + TIE)


def test_dialogue_10b_on_32_a100_40gb_chooses_the_fastest_that_fits():
    plan = choose(DIALOGUE_10B, 32, "A100-40GB", micro_batch=1)
    assert fastest(plan), plan.report()
    ddp = next(c for c in plan.candidates if c.label == "disttrain_ddp")
    assert not ddp.fits
    # No size rule: tensor parallelism is weighed for a 10B model like every other set-up that fits.
    assert any(c.estimate.dims.tp > 1 and c.fits and not c.why for c in plan.candidates)


def test_vit_2b_on_16_a100_chooses_head_split_tensor_parallel():
    # The case's premise: the attention activations overflow a data-parallel rank (batch 64 of 224px images).
    plan = choose(VIT_2B, 16, "A100-40GB", micro_batch=64, activation_checkpointing=False)
    assert plan.strategy == "disttrain_megatron", plan.report()
    e = plan.choice.estimate
    assert e.dims.tp > 1 and e.dims.pp == 1 and not e.activation_checkpointing


def test_deepfm_5b_on_8_t4_chooses_recsys():
    plan = choose(DEEPFM_5B, 8, "T4-16GB", micro_batch=4096)
    assert plan.strategy == "disttrain_recsys", plan.report()
    assert not next(c for c in plan.candidates if c.label == "disttrain_ddp").fits


def test_small_model_that_fits_gets_ddp():
    plan = choose(TINY_LLAMA, 4, "A100-80GB")
    assert plan.strategy == "disttrain_ddp" and fastest(plan)
    assert plan.choice.estimate.micro_batch == 64  # searched: the largest that fits (none is set)


def test_the_plan_says_what_it_assumed_and_the_flag_that_changes_it():
    """A model without a recipe (an HF folder, a config): precision, sequence length and optimizer are the planner's
    assumptions, said in the reasons; what the recipe or the caller fixes is said as fixed instead."""
    said = next(r for r in choose(TINY_LLAMA, 4, "A100-80GB").reasons if "assumed: " in r)
    longest = TINY_LLAMA["max_position_embeddings"]
    assert said.endswith(f"assumed: precision bf16-mixed (--precision to change), seq len {longest} (the model's"
                         " longest; --seq-len to change), AdamW with fp32 moments"), said
    fixed = next(r for r in choose(TINY_LLAMA, 4, "A100-80GB", precision="32-true", seq_len=128).reasons
                 if "assumed: " in r)
    assert fixed.endswith("assumed: AdamW with fp32 moments") and "precision 32-true (as given)" in fixed, fixed
    # DeepFM: no sequence, and its tables' optimizer is the recipe's (Adagrad unless it says otherwise)
    deepfm = next(r for r in choose(DEEPFM_5B, 8, "T4-16GB", micro_batch=4096).reasons if "assumed: " in r)
    assert deepfm.endswith("assumed: precision bf16-mixed (--precision to change)"), deepfm


def test_the_recipe_fixes_batch_precision_and_checkpointing():
    plan = choose(ROOT / "configs/vision/vit2b.yaml", 16, "A100-40GB")
    assert {c.estimate.micro_batch for c in plan.candidates} == {32}  # data.batch_size, not 1
    assert {c.estimate.precision for c in plan.candidates} == {"bf16-mixed"}
    # train.activation_checkpointing: true -> the model recomputes under every strategy, ZeRO-3 included
    assert all(c.estimate.activation_checkpointing for c in plan.candidates)
    assert all("activation_checkpointing" not in c.strategy_options() for c in plan.candidates)
    assert "micro batch 32 (from the recipe)" in plan.report()
    tiny = choose(ROOT / "configs/nlp/dialogue_tiny.yaml", 2, "cpu")
    assert {(c.estimate.micro_batch, c.estimate.precision, c.estimate.seq_len) for c in tiny.candidates} == \
        {(8, "32-true", 256)}
    assert {c.estimate.activation_checkpointing for c in tiny.candidates} == {False}  # the recipe's: off
    searched = choose(ROOT / "configs/nlp/dialogue_moe_tiny.yaml", 2, "cpu")  # a recipe that does not set it
    assert {c.estimate.activation_checkpointing for c in searched.candidates} == {False, True}
    given = choose(ROOT / "configs/vision/vit2b.yaml", 16, "A100-40GB", micro_batch=64, activation_checkpointing=False)
    assert {(c.estimate.micro_batch, c.estimate.activation_checkpointing) for c in given.candidates} == {(64, False)}


def test_available_limits_the_choice():
    plan = choose(VIT_2B, 16, "A100-40GB", micro_batch=64, activation_checkpointing=None,
                  available=["disttrain_ddp", "disttrain_fsdp", "disttrain_zero3"])
    assert plan.choice.estimate.strategy in ("disttrain_fsdp", "disttrain_zero3")
    assert plan.choice.estimate.activation_checkpointing


def test_nothing_fits_is_reported():
    plan = choose(DIALOGUE_10B, 2, hardware("T4-16GB"), available=["disttrain_ddp", "disttrain_fsdp"])
    assert plan.choice is None
    with pytest.raises(RuntimeError, match="no strategy fits"):
        plan.strategy


@pytest.mark.parametrize("call, match", [
    (lambda: estimate(TINY_LLAMA, "fsdp", 2), "disttrain_fsdp"),
    (lambda: estimate(TINY_LLAMA, "disttrain_ddp", 0), "world_size=0"),
    (lambda: estimate(TINY_LLAMA, "disttrain_megatron", 4, tensor_parallel_size=4), "choose one of 1, 2"),
    (lambda: estimate(TINY_LLAMA, "disttrain_fsdp", 2, tensor_parallel_size=2), "disttrain_megatron"),
    (lambda: estimate(TINY_LLAMA, "disttrain_recsys", 2), "embedding tables"),
    (lambda: estimate(TINY_LLAMA, "disttrain_ddp", 2, precision="fp8"), "precision='fp8'"),
    (lambda: model_spec({"layers": 3}), "cannot tell the model family"),
    (lambda: model_spec("no/such.yaml"), "does not exist"),
    (lambda: parse_bytes("40 gigs"), "40GiB"),
    (lambda: hardware("B200"), "not a preset"),
])
def test_bad_input_is_one_clear_error(call, match):
    with pytest.raises((ValueError, FileNotFoundError, TypeError), match=match):
        call()


def test_parse_bytes():
    assert parse_bytes("40GiB") == 40 * 2**30 and parse_bytes("16GB") == 16e9 and parse_bytes(80e9) == 80e9
    assert isinstance(hardware("a100", "80GiB"), Hardware)


@pytest.mark.parametrize("config, gpus, args, expected", [
    ("configs/nlp/dialogue_10b.yaml", "32", ["--gpu-mem", "40GiB"], "recommendation: disttrain_zero3"),
    ("configs/vision/vit2b.yaml", "16", ["--gpu", "A100", "--micro-batch", "64", "--activation-checkpointing", "off"],
     "recommendation: disttrain_megatron tp=2"),
    ("configs/recsys/deepfm_5b.yaml", "8", ["--gpu", "T4", "--micro-batch", "4096"], "recommendation: disttrain_recsys"),
])
@pytest.mark.slow
def test_cli_plan_reproduces_the_reference_cases_from_the_recipe_configs(config, gpus, args, expected):
    root = Path(__file__).resolve().parents[1]
    out = run_python("-m", "disttrain.cli", "plan", "--model", str(root / config), "--gpus", gpus, *args, timeout=300)
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout, out.stdout


@pytest.mark.slow
def test_cli_plan(tmp_path):
    path = tmp_path / "dialogue_10b.yaml"
    path.write_text(yaml.safe_dump({"model": DIALOGUE_10B}))
    out = run_python("-m", "disttrain.cli", "plan", "--model", str(path), "--gpus", "32", "--gpu-mem", "40GiB",
                     "--micro-batch", "1", timeout=300)
    assert out.returncode == 0, out.stderr
    assert "recommendation: disttrain_" in out.stdout and "disttrain_fsdp_offload" in out.stdout
    bad = run_python("-m", "disttrain.cli", "plan", "--model", str(path), "--gpus", "32", "--gpu-mem", "lots", timeout=300)
    assert bad.returncode == 1 and "lots" in bad.stderr


def test_step_time_follows_traffic_and_bandwidth():
    from dataclasses import replace

    from disttrain.planner import step_time

    spec = model_spec(DIALOGUE_10B)
    zero = estimate(spec, "disttrain_zero3", 32)
    assert zero.comm["dp"] == pytest.approx(31 / 32 * spec.params * 6)  # bf16 all-gather x2 + bf16 reduce-scatter
    ddp = estimate(spec, "disttrain_ddp", 32)
    assert ddp.comm["dp"] == pytest.approx(2 * 31 / 32 * spec.params * 4)  # ring all-reduce of fp32 gradients
    a100 = hardware("A100-40GB")
    slow = replace(a100, inter_node_bw=a100.inter_node_bw / 4)
    assert step_time(spec, zero, slow) > step_time(spec, zero, a100)  # communication-bound here
    inside_a_node = estimate(spec, "disttrain_zero3", 8)
    assert step_time(spec, inside_a_node, a100) < step_time(spec, zero, a100)  # NVLink instead of the network


def test_compressed_gradients_send_what_they_declare_and_pay_their_codec():
    """gradient_compression in the estimate: the wire bytes the strategies' layouts declare (bf16 half of fp32, int8
    a quarter plus its scales; HSDP's replicas in bf16 too), PowerSGD's low-rank factors, and the encoding passes
    at memory speed; across slow nodes int8 makes a step of the 10B model faster, within a node of A100s slower."""
    from dataclasses import replace

    from disttrain.planner.steptime import breakdown

    spec = model_spec(DIALOGUE_10B)
    a100 = hardware("A100-40GB")
    plain = estimate(spec, "disttrain_ddp", 32, precision="32-true")
    comm = {kind: estimate(spec, "disttrain_ddp", 32, precision="32-true", gradient_compression=kind).comm["dp"]
            for kind in ("bf16", "fp16", "int8", "powersgd")}
    assert comm["bf16"] == comm["fp16"] == pytest.approx(plain.comm["dp"] / 2)
    assert comm["int8"] == pytest.approx(plain.comm["dp"] * (1 + 4 / 256) / 4)
    # PowerSGD at rank 1: every matrix as its two factors (the 10B model's shapes), the norms whole
    from disttrain.planner.shards import parameter_shapes

    def factors(rank: int) -> int:
        return sum((s[0] + math.prod(s) // s[0]) * rank if len(s) > 1 else math.prod(s)
                   for _, s in parameter_shapes(spec))

    assert comm["powersgd"] == pytest.approx(2 * 31 / 32 * factors(1) * 4) and comm["powersgd"] < plain.comm["dp"] / 400
    rank4 = estimate(spec, "disttrain_ddp", 32, precision="32-true", gradient_compression="powersgd",
                     powersgd_rank=4)
    assert rank4.comm["dp"] == pytest.approx(2 * 31 / 32 * factors(4) * 4)
    fsdp = estimate(spec, "disttrain_fsdp", 32, precision="32-true")
    fsdp8 = estimate(spec, "disttrain_fsdp", 32, precision="32-true", gradient_compression="int8")
    gathers = 31 / 32 * spec.params * 2 * 4  # the fp32 all-gathers stay
    assert fsdp8.comm["dp"] - gathers == pytest.approx((fsdp.comm["dp"] - gathers) * (1 + 4 / 256) / 4)
    hsdp = estimate(spec, "disttrain_fsdp", 32, precision="32-true", hybrid_shard=True, shard_size=8)
    hsdp16 = estimate(spec, "disttrain_fsdp", 32, precision="32-true", hybrid_shard=True, shard_size=8,
                      gradient_compression="bf16")
    assert hsdp16.comm["dp_replicate"] == pytest.approx(hsdp.comm["dp_replicate"] / 2)

    int8 = estimate(spec, "disttrain_ddp", 32, precision="32-true", gradient_compression="int8")
    parts = breakdown(spec, int8, a100)
    assert parts.codec == pytest.approx(36 * 8 * spec.params / a100.memory_bw)
    assert breakdown(spec, plain, a100).codec == 0
    slow = replace(a100, inter_node_bw=0.2e9)  # 1.6 Gbit/s between nodes
    assert breakdown(spec, int8, slow).total < breakdown(spec, plain, slow).total
    one_node = [estimate(spec, "disttrain_ddp", 8, precision="32-true", **kind)
                for kind in ({}, {"gradient_compression": "int8"})]
    assert breakdown(spec, one_node[1], a100).total > breakdown(spec, one_node[0], a100).total  # NVLink: not worth it

# -- any model: HF families beyond Llama, timm models that are not ViTs, measured on the meta device -------------
def tiny_hf(name: str):
    import transformers as tf

    if name == "gpt2":
        return tf.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0)
    if name == "bert":
        return tf.BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                             num_labels=3, architectures=["BertForSequenceClassification"])
    return tf.T5Config(vocab_size=96, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
                       decoder_start_token_id=0, pad_token_id=0)


def real_inputs(name: str, batch: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (batch, seq), generator=g)
    if name == "bert":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (batch,), generator=g)}
    return {"input_ids": ids, "labels": ids, **({"decoder_input_ids": ids} if name == "t5" else {})}


@pytest.mark.parametrize("name", ["gpt2", "bert", "t5", "resnet18"])
def test_generic_activation_estimate_against_saved_tensors(name):
    """A model outside the analytic families is run on the meta device; what it saves for backward there is what a
    real forward saves (T5 within 10%: on CPU its biased attention takes the math kernel, which keeps the scores
    the fused kernels do not)."""
    import timm
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, BertForSequenceClassification

    from disttrain.planner import activation_bytes
    from disttrain.planner.measure import SavedActivations

    torch.manual_seed(0)
    batch, seq = 3, 24
    if name == "resnet18":
        model, args, kwargs, batch = timm.create_model(name, pretrained=False, num_classes=10), None, None, 2
    else:
        cls = {"gpt2": AutoModelForCausalLM, "bert": BertForSequenceClassification, "t5": AutoModelForSeq2SeqLM}[name]
        model = (cls(tiny_hf(name)) if cls is BertForSequenceClassification else cls.from_config(tiny_hf(name)))
        kwargs = real_inputs(name, batch, seq)
    model.train()
    with SavedActivations(model) as saved:
        model(torch.randn(batch, 3, 224, 224)) if kwargs is None else model(**kwargs)
    spec = model_spec(model)
    assert spec.family != "llama" and spec.params == sum(p.numel() for p in model.parameters())
    predicted = activation_bytes(spec, batch, seq, 4)
    assert abs(predicted - saved.bytes()) / saved.bytes() < (0.10 if name == "t5" else 0.02), \
        (name, predicted, saved.bytes())


def test_hf_configs_of_other_families_are_planned_from_their_own_fields(tmp_path):
    import transformers as tf

    gpt2 = tiny_hf("gpt2")
    gpt2.save_pretrained(tmp_path / "gpt2")
    model = tf.GPT2LMHeadModel(gpt2)
    count = sum(p.numel() for p in model.parameters())
    for source in (tmp_path / "gpt2", tmp_path / "gpt2" / "config.json", gpt2, model, gpt2.to_dict()):
        spec = model_spec(source)  # a folder, its config.json, the config object, the module, the dict
        assert (spec.family, spec.params, spec.hidden, spec.heads, spec.layers, spec.tokens) == \
            ("gpt2", count, 64, 4, 2, 64), source
    t5 = model_spec(tiny_hf("t5").to_dict())  # the Llama formulas' keys would be wrong: d_model, num_layers
    assert t5.family == "t5" and t5.hidden == 64 and t5.layers == 4  # encoder and decoder blocks
    assert model_spec(tiny_hf("bert")).layers == 2  # BertLayer x 2 (BertEmbeddings is not a block)
    # GPT-2 has a tensor-parallel plan and pipeline stages; T5 neither: never a megatron candidate
    assert estimate(gpt2, "disttrain_megatron", 2, tensor_parallel_size=2).activations < \
        estimate(gpt2, "disttrain_ddp", 2).activations
    # tied (GPT-2's default): each end of the pipeline holds the tied weight, the last stage's head a copy of it
    tied = estimate(gpt2, "disttrain_megatron", 2, pipeline_parallel_size=2)
    untied = estimate(dict(gpt2.to_dict(), tie_word_embeddings=False), "disttrain_megatron", 2,
                      pipeline_parallel_size=2)
    assert tied.activations > 0 and tied.params >= untied.params  # the tie saves nothing per rank there
    with pytest.raises(ValueError, match="a t5 model has none"):
        estimate(t5, "disttrain_megatron", 2, tensor_parallel_size=2)


def test_timm_models_by_name():
    resnet = model_spec("resnet18")
    assert resnet.family == "timm ResNet" and resnet.params == 11_689_512 and resnet.layers == 8
    e = estimate(resnet, "disttrain_ddp", 2, micro_batch=32, precision="32-true")
    assert 0.6e9 < e.activations < 0.8e9  # ~22 MB per 224px image in fp32 (a CPU forward of 2 saves 44.4 MB)
    assert model_spec("vit_small_patch16_224").family == "vit"  # ViTs keep the analytic formulas
    with pytest.raises(ValueError, match=r"did you mean resnet18"):
        model_spec("resnet_18")


def test_a_module_without_inputs_is_planned_from_its_parameters_and_says_so():
    from torch import nn

    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    plan = choose(model, 2, "A100-80GB")
    assert plan.spec.params == 4 * (32 * 32 + 32) and plan.strategy == "disttrain_ddp"
    assert any("example_input_array" in r for r in plan.reasons)


def test_cli_plan_on_an_hf_config_folder_and_timm_names(tmp_path, capsys):
    from disttrain.cli import main

    tiny_hf("gpt2").save_pretrained(tmp_path / "gpt2")
    for model, expected in ((str(tmp_path / "gpt2"), "model: gpt2"), ("resnet18", "model: timm ResNet"),
                            ("convnext_atto", "model: timm ConvNeXt")):
        assert main(["plan", "--model", model, "--gpus", "8", "--gpu-mem", "16GiB", "--micro-batch", "8"]) == 0
        out = capsys.readouterr().out
        assert expected in out and "recommendation: disttrain_" in out, out
        assert "measured by running the model's forward on the meta device" in out
    assert main(["plan", "--model", "resnet_18", "--gpus", "8"]) == 1
    assert "did you mean resnet18" in capsys.readouterr().err


def test_a_lightning_module_is_measured_with_its_example_input():
    import lightning as L
    from torch import nn

    from disttrain.planner import activation_bytes
    from disttrain.planner.measure import SavedActivations

    class Module(L.LightningModule):
        def __init__(self, fail: bool = False):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
            self.example_input_array = torch.randn(2, 16)
            self.fail = fail

        def forward(self, x):
            if self.fail and x.sum() > 0:  # data-dependent: cannot be answered without data
                return x
            return self.net(x)

    module = Module()
    with SavedActivations(module) as saved:
        module(torch.randn(8, 16))
    spec = model_spec(module)
    assert activation_bytes(spec, 8, 1, 4) == saved.bytes()  # the example's batch of 2 resized to 8
    with pytest.raises(ValueError, match="cannot run Module's forward on the meta device .* planner_model"):
        activation_bytes(model_spec(Module(fail=True)), 8, 1, 4)


def test_long_dialogues_are_planned_with_context_parallelism():
    """At 32k tokens a sequence's activations overflow a rank under every data-parallel strategy: the planner
    estimates context-parallel plans next to recomputation, picks the fastest that fits and says why."""
    plan = choose("configs/nlp/dialogue_10b_32k.yaml", 32, "A100-40GB")
    e = plan.choice.estimate
    assert e.dims.cp > 1 and e.options == {"context_parallel_size": e.dims.cp}, plan.report()
    labels = [c.label for c in plan.candidates]
    assert "disttrain_fsdp +AC" in labels and any("cp=2" in label for label in labels)
    assert any(r.startswith("context parallelism considered: 32768 tokens") for r in plan.reasons)
    assert any(r.startswith("splitting the sequence against recomputing it") for r in plan.reasons)
    # per rank: 1/cp of every sequence's activations, for all-to-all traffic on the critical path
    one = estimate("configs/nlp/dialogue_10b_32k.yaml", "disttrain_megatron", 32, tensor_parallel_size=2)
    four = estimate("configs/nlp/dialogue_10b_32k.yaml", "disttrain_megatron", 32, tensor_parallel_size=2,
                    context_parallel_size=4)
    assert four.dims.degrees() == {"dp_shard": 4, "cp": 4, "tp": 2} and one.comm["cp"] == 0 < four.comm["cp"]
    assert four.activations == pytest.approx(one.activations / 4, rel=0.01)
    assert four.states == pytest.approx(one.states, rel=1e-3)  # FSDP shards over dp_shard x cp: 16 ranks either way
    # no context-parallel plans for short sequences
    assert not any(c.estimate.dims.cp > 1 for c in choose("configs/nlp/dialogue_10b.yaml", 32, "A100-40GB").candidates)


@pytest.mark.parametrize("call, match", [
    (lambda: estimate(TINY_LLAMA, "disttrain_megatron", 4, context_parallel_size=4, seq_len=30),
     "context_parallel_size=4 does not divide seq_len=30"),
    (lambda: estimate("resnet18", "disttrain_megatron", 2, context_parallel_size=2), "has none it knows"),
    (lambda: estimate(TINY_LLAMA, "disttrain_megatron", 4, context_parallel_size=2, pipeline_parallel_size=2),
     "context_parallel_size=2 with pipeline_parallel_size=2"),
])
def test_context_parallel_sizes_it_cannot_split_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_hsdp_is_a_candidate_when_the_world_spans_nodes():
    """Across nodes the planner also shards FSDP within each node and replicates across (HSDP): its gathers and
    reduce-scatters go over the node's links, only the gradient all-reduce across the replicas over the network."""
    from dataclasses import replace

    from disttrain.planner.steptime import across_nodes, breakdown, crosses_nodes

    a100 = hardware("A100-40GB")
    plan = choose(DIALOGUE_10B, 32, a100, micro_batch=1)
    hsdp = [c for c in plan.candidates if c.estimate.dims.hybrid]
    assert [c.label for c in hsdp] == ["disttrain_fsdp hsdp shard=8 x 4", "disttrain_fsdp hsdp shard=8 x 4 +AC"]
    assert hsdp[0].strategy_options() == {"hybrid_shard": True, "shard_size": 8}
    e = hsdp[0].estimate
    fsdp = next(c for c in plan.candidates if c.label == "disttrain_fsdp").estimate
    assert e.states == pytest.approx(4 * fsdp.states, rel=1e-3)  # a copy per node: 8 shards, not 32
    assert crosses_nodes(e, a100) == dict(crosses_nodes(fsdp, a100), dp=False, after_step=False)
    assert across_nodes(e, a100) == e.comm["dp_replicate"] < across_nodes(fsdp, a100) / 10
    # a slower network slows only the replicas' all-reduce
    slow = replace(a100, inter_node_bw=a100.inter_node_bw / 4)
    gathers = breakdown(model_spec(DIALOGUE_10B), e, a100).dp - e.comm["dp_replicate"] / a100.inter_node_bw
    assert breakdown(model_spec(DIALOGUE_10B), e, slow).dp == pytest.approx(
        gathers + e.comm["dp_replicate"] / slow.inter_node_bw, rel=1e-6)
    # one node: nothing to replicate across; offload variants are planned as registered
    assert not any(c.estimate.dims.hybrid for c in choose(DIALOGUE_10B, 8, a100, micro_batch=1).candidates)
    assert not any(c.estimate.dims.hybrid and c.layout.offloaded for c in plan.candidates)


def test_cli_plan_lists_hsdp_with_its_traffic_across_nodes(capsys):
    """`disttrain plan --model configs/nlp/dialogue_10b.yaml --gpus 32 --gpus-per-node 8` (A100-class 80 GB)."""
    from disttrain.cli import main

    assert main(["plan", "--model", str(ROOT / "configs/nlp/dialogue_10b.yaml"), "--gpus", "32",
                 "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("strategy"))
    assert head.split()[-2:] == ["x-node", "GB"]
    rows = {line[:46].strip(): line.split() for line in out.splitlines() if line.startswith("disttrain_fsdp")}
    # the 10B model's fp32 gradient shard (1/8 of it) all-reduced across 4 replicas, against FSDP's 32-way traffic
    assert float(rows["disttrain_fsdp hsdp shard=8 x 4"][-1]) == pytest.approx(7.62, abs=0.01)
    assert float(rows["disttrain_fsdp"][-1]) == pytest.approx(78.7, abs=0.1)
    # On 80 GB GPUs a node's copy of the states fits without recomputation, and HSDP is estimated fastest
    assert "recommendation: disttrain_fsdp hsdp shard=8 x 4  {'hybrid_shard': True, 'shard_size': 8}" in out
    assert "dp 71.1 GB, dp_replicate 7.62 GB; across nodes 7.62 GB (dp_replicate))" in out


def test_lora_is_planned_as_adapters_on_a_frozen_model():
    """``lora_rank``: the adapters peft adds (all-linear) are what the planner counts; only they have gradients and
    optimizer state and reduce gradients; the frozen base is still held (and gathered) and skips its weight
    gradients in the step time. A table model refuses it."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from disttrain.planner.estimate import lora_elements
    from disttrain.planner.steptime import breakdown

    model = peft.get_peft_model(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)),
                                peft.LoraConfig(r=4, target_modules="all-linear"))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    params = sum(p.numel() for p in model.parameters()) - adapters
    assert lora_elements(model_spec(TINY_LLAMA), 4) == adapters
    for strategy, shards in (("disttrain_ddp", 1), ("disttrain_fsdp", 2)):
        full = estimate(TINY_LLAMA, strategy, 2, seq_len=64)
        lora = estimate(TINY_LLAMA, strategy, 2, seq_len=64, lora_rank=4)
        assert lora.grads == math.ceil(adapters / shards) * full.grads // math.ceil(params / shards)
        assert lora.optimizer == math.ceil(adapters / shards) * full.optimizer // math.ceil(params / shards)
        assert lora.params > full.params and lora.comm["dp"] < full.comm["dp"]
        hw = hardware("A100-80GB")
        assert breakdown(model_spec(TINY_LLAMA), lora, hw).compute < breakdown(model_spec(TINY_LLAMA), full, hw).compute
    with pytest.raises(ValueError, match="lora_rank=4: disttrain_recsys places embedding tables"):
        estimate(DEEPFM_5B, "disttrain_recsys", 2, lora_rank=4)
