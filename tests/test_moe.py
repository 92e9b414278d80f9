"""Expert parallelism (``disttrain_megatron(expert_parallel_size=...)``) on HF MoE models against one process, and
the router's auxiliary loss under every sharded strategy."""

from __future__ import annotations

import pytest
import torch

from conftest import run_dist

from disttrain.parallel.mesh import ParallelDims

EP = "disttrain_megatron:expert_parallel_size=2"
EP_TP = "disttrain_megatron:expert_parallel_size=2,tensor_parallel_size=2"
REL = 1e-5


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """ep=2 on Mixtral, Qwen2-MoE and Qwen3-MoE; FSDP on Mixtral (its auxiliary loss); the Trainer at ep=2."""
    return run_dist("moe_run.py", tmp_path_factory.mktemp("moe2"), "disttrain_fsdp@mixtral", EP, "--", "mixtral",
                    "qwen2-moe", "qwen3-moe")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """ep=2 x FSDP over 4 data-parallel ranks (Mixtral), and ep=2 x tp=2 (Qwen2-MoE, its shared expert split too);
    the Trainer at ep=2 x tp=2 (Mixtral)."""
    return run_dist("moe_run.py", tmp_path_factory.mktemp("moe4"), f"{EP}@mixtral", f"{EP_TP}@qwen2-moe", "--",
                    "mixtral", nproc=4)


def check(result: dict) -> None:
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=REL)
    # the checkpoint resumed into other weights continues the one-process run
    assert result["resumed"] == pytest.approx(result["ref_resumed"], rel=REL)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_expert_parallel_matches_one_process(two_ranks, model):
    result = two_ranks[0][EP][model]
    check(result)
    assert result["export_diff"][0] <= REL, result["export_diff"]  # export_full: the model's own layout
    for rank in two_ranks:  # each rank computes with half the experts and stores them (no copies to shard)
        share = rank[EP][model]["experts"]
        assert share["computed"] * 2 == share["whole"] and share["stored"] * 2 == share["whole"]


@pytest.mark.slow
def test_fsdp_keeps_the_router_auxiliary_loss(two_ranks):
    # fully_shard gives the model a class of its own; transformers must still record the router logits
    result = two_ranks[0]["disttrain_fsdp"]["mixtral"]
    check(result)
    assert result["export_diff"][0] <= REL


@pytest.mark.slow
@pytest.mark.parametrize("ranks", ["two", "four"])
def test_expert_parallel_trains_through_the_trainer(two_ranks, four_ranks, ranks):
    result = (two_ranks if ranks == "two" else four_ranks)[0]["trainer"]
    assert result["loss"] == pytest.approx(result["ref_loss"], rel=REL)


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "model"), [(EP, "mixtral"), (EP_TP, "qwen2-moe")])
def test_expert_parallel_composes_with_fsdp_and_tensor_parallel(four_ranks, spec, model):
    check(four_ranks[0][spec][model])
    assert four_ranks[0][spec][model]["export_diff"][0] <= REL
    for rank in four_ranks:
        share = rank[spec][model]["experts"]
        assert share["computed"] * 2 == share["whole"]  # ep=2: each rank computes with half the experts
        # ep x FSDP over 4 ranks: each expert is also sharded over the 2 ranks that hold it; under tp=2 the
        # tensor-parallel ranks hold whole experts
        assert share["stored"] * (4 if spec == EP else 2) == share["whole"]


# -- refusals, no processes ---------------------------------------------------------------------------------------
def test_expert_parallel_meshes_on_a_fake_world():
    from disttrain.simulate.fake import fake_world

    dims = ParallelDims(8, tp=2, ep=2)
    at = dims.coordinates(5)
    with fake_world(5, 8):
        meshes = dims.build("cpu")
        assert meshes.world.mesh_dim_names == ("dp_shard_mod_ep", "ep", "tp")
        assert (meshes.dp.size(), meshes.fsdp.size(), meshes.ep.size(), meshes.expert_fsdp.size()) == (4, 4, 2, 2)
        # expert-parallel neighbours are data-parallel neighbours: rank 5 is dp_shard 2, ep rank 0 of its pair
        assert meshes.dp.get_local_rank() == at["dp_shard"] == 2
        assert meshes.ep.get_local_rank() == at["dp_shard"] % 2 and meshes.ep_tokens.size() == 1


@pytest.mark.parametrize(("sizes", "error"), [
    (dict(world_size=4, ep=2, pp=2), r"ep=2 with .*pp=2.*use cp=1, dp_replicate=1 and pp=1"),
    (dict(world_size=4, ep=4, dp_shard=2, cp=2), r"ep=4 does not divide dp_shard=2"),
])
def test_expert_parallel_sizes_are_checked(sizes, error):
    from disttrain.simulate.fake import fake_world

    with pytest.raises(ValueError, match=error):
        dims = ParallelDims(**sizes)
        with fake_world(0, sizes["world_size"]):
            dims.build("cpu")


def test_expert_parallel_refuses_what_has_no_experts_and_sizes_that_do_not_divide_them():
    import transformers as tf

    from disttrain.parallel.engines.megatron import MegatronEngine, MegatronOptions
    from disttrain.parallel.families import family_of
    from disttrain.parallel.families.hf_plans import HF_PLANS

    with pytest.raises(ValueError, match=r"expert_parallel_size=2 with context_parallel_size=2 .* use"
                                         r" context_parallel_size=1"):
        MegatronEngine.parallel_dims(MegatronOptions(expert_parallel_size=2, context_parallel_size=2), 8)
    mixtral = tf.MixtralForCausalLM(tf.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16,
                                                     num_hidden_layers=1, num_attention_heads=2,
                                                     num_key_value_heads=1, num_local_experts=6))
    assert family_of(mixtral) is HF_PLANS and HF_PLANS.num_experts(mixtral) == 6

    class FakeMesh:
        def size(self) -> int:
            return 4

    with pytest.raises(ValueError, match=r"expert_parallel_size=4 does not divide the model's 6 experts; choose one"
                                         r" of 1, 2, 3, 6"):
        HF_PLANS.apply_ep(mixtral, FakeMesh(), None, 1)
    phi3 = tf.Phi3ForCausalLM(tf.Phi3Config(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, pad_token_id=0))
    with pytest.raises(ValueError, match=r"Phi3ForCausalLM's config declares no expert-parallel plan"):
        HF_PLANS.apply_ep(phi3, FakeMesh(), None, 1)
    with pytest.raises(ValueError, match=r"tp_plan=.* applies with expert_parallel_size=1"):
        MegatronOptions(expert_parallel_size=2, tensor_parallel_size=2, tp_plan={})


def test_the_planner_and_the_simulator_count_experts_by_expert_parallel_size():
    """The engine's own sharding on the fake group (disttrain simulate) and the planner's count agree on a rank's
    model states under ep=2, and per-rank expert bytes fall with ep (each rank keeps ep's share of the experts)."""
    from disttrain.planner import estimate, model_spec
    from disttrain.simulate import simulate

    config = "configs/nlp/dialogue_moe_tiny.yaml"
    spec = model_spec(config)
    assert spec.extra["experts"] == {"params": 1179648, "count": 8, "top_k": 2}
    sim = simulate(config, "disttrain_megatron", 4, precision="32-true", expert_parallel_size=2)
    est = estimate(spec, "disttrain_megatron", 4, precision="32-true", expert_parallel_size=2, micro_batch=2,
                   seq_len=64)
    assert sim.busiest.params == pytest.approx(est.params, rel=0.02)
    assert est.comm["ep"] > 0 and any("expert parallelism" in note for note in sim.notes)
    # tp=2 x ep=2: attention split in two, experts whole on each tensor-parallel rank
    tp = estimate(spec, "disttrain_megatron", 4, precision="32-true", expert_parallel_size=2, tensor_parallel_size=2)
    experts_per_rank = spec.extra["experts"]["params"] / 2 * 4  # ep=2, one copy per tensor-parallel rank, fp32
    assert tp.params >= experts_per_rank
    with pytest.raises(ValueError, match=r"expert_parallel_size=2: a llama model has no experts"):
        estimate(model_spec("configs/nlp/dialogue_tiny.yaml"), "disttrain_megatron", 2, expert_parallel_size=2)


def test_mfu_counts_the_active_parameters_of_an_moe_model():
    import transformers as tf

    from disttrain.callbacks import hf_transformer_dims

    config = tf.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                              num_experts_per_tok=2, tie_word_embeddings=False)
    model = tf.MixtralForCausalLM(config)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    total = sum(p.numel() for p in model.parameters())
    # the input embedding is a lookup; of each layer's 8 experts a token meets 2
    assert hf_transformer_dims(model).n_params == total - 64 * 32 - experts * 6 // 8
