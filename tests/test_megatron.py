"""disttrain_megatron: tensor, pipeline and 3D parallelism against one process, on CPU/gloo."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import run_dist
from safetensors.torch import load_file

from disttrain.parallel.engines.megatron import MegatronOptions
from disttrain.parallel.families.base import check_heads
from disttrain.parallel.families.layout import qkv_rank_major, restore_rows
from disttrain.parallel.mesh import ParallelDims
from disttrain.parallel.options import build_options
from disttrain.parallel.split.pipeline import plan_stages
from disttrain.parallel.split.tp import apply_tp

TOL = 1e-5


def megatron(**options: object) -> str:
    return "disttrain_megatron:" + ",".join(f"{k}={v}" for k, v in options.items())


# -- sizes and plans, no processes ----------------------------------------------------------------------------
def test_indivisible_sizes_are_rejected_with_the_valid_choices():
    with pytest.raises(ValueError, match=r"world_size=4 is not divisible by tp=3; choose sizes"):
        ParallelDims(world_size=4, tp=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_heads=4; choose 1, 2 or 4"):
        check_heads(3, num_heads=4)
    with pytest.raises(ValueError, match="num_key_value_heads=2; choose 1 or 2"):
        check_heads(4, num_attention_heads=8, num_key_value_heads=2)
    with pytest.raises(ValueError, match="cannot fill pipeline_parallel_size"):
        plan_stages([10, 10, 10], pp=2, virtual_stages=2)
    with pytest.raises(ValueError, match=r"split_points=\[3\] must be 1 increasing block indices"):
        plan_stages([10, 10, 10], pp=2, split_points=[3])
    with pytest.raises(TypeError, match="unknown option .tensor_parallel. .* did you mean .tensor_parallel_size."):
        build_options(MegatronOptions, "disttrain_megatron", {"tensor_parallel": 2})


def test_tp_plan_checks_the_model_heads_before_sharding():
    from common import tiny_llama

    class FakeMesh:  # only its size is read before the head check fails
        def size(self) -> int:
            return 8

    with pytest.raises(ValueError, match="tensor_parallel_size=8 does not divide num_attention_heads=4"):
        apply_tp(tiny_llama(), FakeMesh())


def test_stages_balance_parameters_and_respect_split_points():
    # 4 equal blocks, embeddings and head small: two stages of two blocks; interleaved: one block per stage
    assert plan_stages([37] * 4, pp=2, first_extra=6, last_extra=6).bounds == ((0, 2), (2, 4))
    assert plan_stages([37] * 4, pp=2, virtual_stages=2).bounds == ((0, 1), (1, 2), (2, 3), (3, 4))
    # a heavy first block (e.g. with the embeddings) gets a stage of its own
    assert plan_stages([5, 1, 1, 1, 1, 1], pp=2).bounds == ((0, 1), (1, 6))
    assert plan_stages([1] * 6, pp=2, split_points=[4]).bounds == ((0, 4), (4, 6))
    plan = plan_stages([1] * 8, pp=2, virtual_stages=2)
    assert plan.stages_of(0) == [0, 2] and plan.stages_of(1) == [1, 3]
    # V-shaped (zbv, dualpipev): rank 0 runs the first and the last stage
    plan = plan_stages([1] * 8, pp=2, virtual_stages=2, style="v")
    assert plan.stages_of(0) == [0, 3] and plan.stages_of(1) == [1, 2] and plan.rank_of(3) == 0


def test_balanced_split_minimises_the_costliest_stage():
    # cutting where the running cost nears each stage's share gave 1 | 3 + 1 | 2 (the costliest stage: 4)
    assert plan_stages([1, 3, 1, 2], pp=3).bounds == ((0, 1), (1, 2), (2, 4))  # 1 | 3 | 1 + 2
    # a head and loss worth 2.5 blocks on the last stage: it gets fewer blocks (7 | 3 + 2.5)
    assert plan_stages([1] * 10, pp=2, last_extra=2.5).bounds == ((0, 6), (6, 10))
    # three stages, embeddings worth 3 blocks on the first: 1 + 3 | 4 | 4
    assert plan_stages([1] * 9, pp=3, first_extra=3).bounds == ((0, 1), (1, 5), (5, 9))


def test_block_costs_count_the_head_and_loss_and_balance_the_stages():
    from common import tiny_llama

    from disttrain.parallel.split.pipeline import block_costs, block_sizes

    model = tiny_llama(layers=8)
    model.config.vocab_size = 1024  # a head worth ~1.5 blocks of this tiny model
    model.lm_head = torch.nn.Linear(64, 1024, bias=False)
    costs, first, last = block_costs(model)
    # matmul and attention FLOPs of one 64-token sample: equal blocks; the embedding lookup costs none; the head
    # (2 x 64 x 1024 per token) and the loss's log-softmax over the vocabulary (5 per logit) after the last block
    assert len(set(costs)) == 1 and first == 0
    assert last == 64 * (2 * 64 * 1024 + 5 * 1024)
    plan = plan_stages(costs, pp=2, first_extra=first, last_extra=last)
    assert plan.bounds == ((0, 5), (5, 8))  # the last stage takes fewer blocks: 5 | 3 + head
    # a model whose forward cannot run on the meta device is balanced by parameter count
    assert block_sizes(model)[0] == [36992] * 8


@pytest.mark.parametrize(("options", "message"), [
    ({"pipeline_schedule": "zbv", "virtual_stages": 3}, "'zbv' runs exactly 2 stages per rank .* set it to 2"),
    ({"pipeline_schedule": "1f1b", "virtual_stages": 2}, "virtual_stages=2 needs a schedule with several stages"),
    ({"pipeline_schedule": "interleaved_zero_bubble", "microbatches": 3},
     "'interleaved_zero_bubble' needs microbatches a multiple of pipeline_parallel_size=2; got microbatches=3"),
    ({"pipeline_schedule": "dualpipev", "microbatches": 2}, "'dualpipev' needs microbatches at least the number"
                                                             " of stages, 2 \\* pipeline_parallel_size = 4"),
    ({"pipeline_schedule": "zbv", "microbatches": 2}, "'zbv' needs microbatches at least 2 \\*"),
    ({"pipeline_schedule": "1f1b", "microbatches": 1}, "'1f1b' needs microbatches at least pipeline_parallel"),
    ({"pipeline_schedule": "zero_bubble"}, "unknown pipeline_schedule='zero_bubble'; choose one of"),
])
def test_invalid_schedule_combinations_are_refused_when_the_strategy_is_made(options, message):
    with pytest.raises(ValueError, match=message):
        MegatronOptions(pipeline_parallel_size=2, **options)


def test_fused_qkv_reorder_gives_each_rank_its_heads_and_is_undone_for_export():
    dim, tp = 8, 2  # rows: q0..q7 | k0..k7 | v0..v7 (4 heads of 2)
    order = qkv_rank_major(dim, tp)
    weight = torch.arange(3 * dim, dtype=torch.float32).unsqueeze(1)
    shards = weight[order].chunk(tp)
    assert shards[0].flatten().tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]  # q, k, v of heads 0-1
    assert shards[1].flatten().tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    state = restore_rows({"blocks.0.attn.qkv.weight": weight[order]}, {"blocks.0.attn.qkv": order})
    assert torch.equal(state["blocks.0.attn.qkv.weight"], weight)


# -- tensor parallel: forward and backward equal one process ----------------------------------------------------
@pytest.mark.slow
def test_a_meta_device_model_has_the_same_whole_tensors_on_every_rank_of_a_tp_group(tmp_path):
    """empty_init under tp=2: each rank initialised its own copy of what TP leaves whole (the patch and position
    embeddings, the head), and the group then computed different logits for the same images (a ViT's differed by
    0.76); the copies now hold the first rank's values."""
    first, second = run_dist("meta_copies.py", tmp_path, "tp")
    assert first["sums"] == second["sums"]
    assert first["logits"] == second["logits"]


@pytest.mark.slow
def test_a_meta_device_vits_class_token_is_the_same_on_the_data_parallel_ranks_of_a_stage(tmp_path):
    """empty_init under pp=2 x dp=2: a ViT's class token and position embedding belong to no stage module (they
    stay whole on the first stage's ranks, their gradients averaged over data parallel), and each data-parallel
    rank had drawn its own (position embeddings summing to -0.13 and -0.46): the replicas trained different
    copies. They now hold the first data-parallel rank's values."""
    results = run_dist("meta_copies.py", tmp_path, "pp", nproc=4)
    assert results[0]["plain"] == ["cls_token", "pos_embed"]  # the parameters this is about, on the first stage
    assert results[0]["sums"] == results[1]["sums"] and results[2]["sums"] == results[3]["sums"]
    assert results[0]["sums"].keys() != results[2]["sums"].keys()  # two stages, each holding its own blocks


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "vit"])
def test_tp2_forward_and_backward_match_one_process(tmp_path, family):
    result = run_dist("megatron_fabric.py", tmp_path, megatron(tensor_parallel_size=2), f"grads-{family}")[0]
    assert result["params_compared"] == result["params_total"]
    assert result["logits_diff"] <= TOL and result["grad_diff"] <= TOL, result


# -- pipeline parallel inside the Trainer: training_step written for one process -------------------------------
TRAINER_CASES = {  # name: (model, strategy, processes); llama-gpipe also saves and resumes a Trainer checkpoint
    "llama-gpipe": ("llama", megatron(pipeline_parallel_size=2, microbatches=2, pipeline_schedule="gpipe"), 2),
    "llama-interleaved": ("llama", megatron(pipeline_parallel_size=2, microbatches=2,
                                            pipeline_schedule="interleaved_1f1b"), 2),
    "vit-1f1b-loss-hook": ("vit", megatron(pipeline_parallel_size=2, microbatches=2), 2),
    "gpt2-1f1b": ("gpt2", megatron(pipeline_parallel_size=2, microbatches=2), 2),
    "vit-tp2": ("vit", megatron(tensor_parallel_size=2), 2),
    "llama-tp2-ac": ("llama", megatron(tensor_parallel_size=2, activation_checkpointing=True), 2),
    "llama-tp2-pp2": ("llama", megatron(tensor_parallel_size=2, pipeline_parallel_size=2, microbatches=2), 4),
    # zero-bubble schedules beside other dimensions: data parallel (2 stages per rank), tensor parallel (V-shape).
    # At dp=2 each rank's 6 samples make a batch of 4, then a partial one of 2: the stages' shapes change mid-epoch.
    "llama-izb-pp2-dp2": ("llama", megatron(pipeline_parallel_size=2, microbatches=2,
                                            pipeline_schedule="interleaved_zero_bubble"), 4),
    "llama-zbv-tp2-pp2": ("llama", megatron(tensor_parallel_size=2, pipeline_parallel_size=2, microbatches=4,
                                            pipeline_schedule="zbv"), 4),
    # context parallelism under the Trainer (cp x tp against one process: tests/test_cp_core.py)
    "llama-cp2": ("llama", megatron(context_parallel_size=2), 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_trainer_matches_one_process(tmp_path, case):
    family, spec, nproc = TRAINER_CASES[case]
    resume = case == "llama-gpipe"
    results = run_dist("megatron_trainer.py", tmp_path, spec, family, *(["resume"] if resume else []), nproc=nproc)
    for result in results:  # the loss is logged on every rank, pipeline stages included
        assert result["losses"] == pytest.approx(result["ref_losses"][:3], abs=TOL)
        if resume:  # a DCP checkpoint of both stages, resumed by a new Trainer: step 4 as in one process
            assert result["resumed"] == pytest.approx(result["ref_losses"][3:], abs=TOL)
        assert result["val"] == pytest.approx(result["ref_val"], abs=TOL)  # validation under PP/TP
        # self.log(..., reduce_fx="sum", sync_dist=True) sums over the data-parallel ranks, not every process
        assert result["samples"]["logged"] == result["samples"]["seen"], result["samples"]
        assert result["votes"] == [True, True, False]  # all, any (rank 0 alone), all (rank 0 alone)
    assert results[0]["export_diff"] <= TOL  # the exported full model = the one-process model's state dict
    # gradient_clip_val clipped every step, by the whole model's norm (not one stage's, not one mesh's)
    assert min(results[0]["ref_norms"]) > results[0]["clip"]


# -- gradient clipping by the whole model's norm: FSDP shards, TP's two meshes, pipeline stages ----------------
@pytest.mark.slow
@pytest.mark.parametrize("spec", ["disttrain_fsdp", megatron(tensor_parallel_size=2),
                                  megatron(pipeline_parallel_size=2, microbatches=2)])
def test_fabric_clip_gradients_uses_the_whole_model_norm(tmp_path, spec):
    """Before: TP failed ("operands ... must have the same mesh") and each pipeline stage clipped by its own norm."""
    for result in run_dist("megatron_fabric.py", tmp_path, spec, "clip"):
        assert min(result["ref_norms"]) > result["max_norm"]  # clipping was active every step
        assert result["norms"] == pytest.approx(result["ref_norms"], rel=1e-5)
        assert result["losses"] == pytest.approx(result["ref_losses"], abs=TOL)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_equals_torch_in_one_process_and_refuses_nonfinite_norms(norm_type):
    from disttrain.parallel.engines.clip import clip_grad_norm_

    def model_with_grads() -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        model(torch.randn(4, 8)).pow(2).sum().backward()
        return model

    ours, theirs = model_with_grads(), model_with_grads()
    norm = clip_grad_norm_(ours.parameters(), 0.1, norm_type)
    assert norm.item() == pytest.approx(torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1, norm_type).item())
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    next(ours.parameters()).grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="nan or inf; pass error_if_nonfinite=False"):
        clip_grad_norm_(ours.parameters(), 0.1, norm_type)


@pytest.mark.parametrize("foreach", [None, True])
def test_a_group_of_dtensors_and_plain_tensors_steps_and_keeps_its_foreach_setting(foreach):
    """A ViT's class token stays a plain tensor beside the stages' DTensors under pipeline parallelism: torch's
    foreach AdamW (its default on GPUs, asked for here on the CPU) fails on that group's first step. Settled, it steps
    as torch's per-tensor AdamW does, and the group's ``foreach`` is the user's again after the step (checkpoints)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from disttrain.parallel.engines.base import Engine
    from disttrain.simulate.fake import fake_world

    def adamw(on: bool | None, mesh) -> torch.optim.AdamW:
        torch.manual_seed(0)
        block = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))
        cls_token = torch.nn.Parameter(torch.randn(1, 4))
        for p in (block, cls_token):
            p.grad = torch.ones_like(p)
        return torch.optim.AdamW([block, cls_token], lr=0.1, foreach=on)

    with fake_world(0, 2):
        mesh = init_device_mesh("cpu", (2,))
        failing = adamw(True, mesh)
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            failing.step()
        settled, reference = adamw(foreach, mesh), adamw(False, mesh)
        Engine.settle_optimizers([settled])
        Engine.settle_optimizers([settled])  # set up again: hooked once
        for _ in range(2):
            settled.step()
            reference.step()
        assert settled.param_groups[0]["foreach"] is foreach
        assert len(settled._optimizer_step_pre_hooks) == 1
        for hook in (*settled._optimizer_step_pre_hooks.values(), *settled._optimizer_step_pre_hooks.values(),
                     *settled._optimizer_step_post_hooks.values()):  # a step that raised between its hooks
            hook(settled, (), {})
        assert settled.param_groups[0]["foreach"] is foreach
        for a, b in zip(settled.param_groups[0]["params"], reference.param_groups[0]["params"]):
            assert isinstance(a, DTensor) == isinstance(b, DTensor)
            torch.testing.assert_close(a.full_tensor() if isinstance(a, DTensor) else a,
                                       b.full_tensor() if isinstance(b, DTensor) else b, rtol=0, atol=0)
        plain = torch.optim.AdamW([torch.nn.Parameter(torch.randn(2))], foreach=True)
        Engine.settle_optimizers([plain])  # one kind of tensor: left as it is
        assert not plain._optimizer_step_pre_hooks


# -- pipeline parallel through Fabric: 1F1B, memory per rank, DCP save and resume; every schedule ----------------
@pytest.fixture(scope="module")
def fabric_pp2(tmp_path_factory) -> list[dict]:
    """One launch: 1F1B trained, saved and resumed ("train"), then each schedule and split ("schedules")."""
    return run_dist("megatron_fabric.py", tmp_path_factory.mktemp("fabric_pp2"),
                    megatron(pipeline_parallel_size=2, microbatches=2), "train+schedules+tied")


@pytest.mark.slow
def test_fabric_pp2_1f1b_trains_keeps_one_stage_and_resumes(fabric_pp2):
    from common import reference_losses, tiny_llama

    results = fabric_pp2
    expected = reference_losses(3, world_size=1)
    for result in results:
        assert result["losses"] == pytest.approx(expected, abs=TOL)
        assert result["resumed"] == pytest.approx(result["losses"][2], abs=TOL)
    # each rank holds only its stage: together exactly the model, each about half
    locals_ = [r["local_params"] for r in results]
    assert sum(locals_) == results[0]["total_params"] and max(locals_) < 0.6 * results[0]["total_params"]
    exported = load_file(results[0]["export"])
    assert sorted(exported) == sorted(tiny_llama().state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["1f1b", "1f1b-split", "interleaved_zero_bubble", "zbv", "dualpipev"])
def test_pipeline_schedules_and_splits_match_one_process(fabric_pp2, case):
    """Losses of 2 steps, this rank's gradients and parameters after the first, and an evaluation loss, against
    one process (fp32, 2 processes: 4 stages of a 4-layer Llama for the schedules with 2 stages per rank)."""
    for result in fabric_pp2:
        run = result[case]
        assert run["losses"] == pytest.approx(result["ref_losses"], abs=TOL)
        assert run["grad_diff"] <= TOL and run["param_diff"] <= TOL, run
        assert run["eval"] == pytest.approx(result["ref_eval"], abs=TOL)
    placement = {"1f1b": [[0], [1]], "1f1b-split": [[0], [1]], "interleaved_zero_bubble": [[0, 2], [1, 3]],
                 "zbv": [[0, 3], [1, 2]], "dualpipev": [[0, 3], [1, 2]]}[case]
    assert [r[case]["stages"] for r in fabric_pp2] == placement
    # the balanced split of 4 equal layers (the small head on the last stage) is 2 | 2; split_points=[1] is 1 | 3
    bounds = {"1f1b": [[0, 2], [2, 4]], "1f1b-split": [[0, 1], [1, 4]]}.get(case, [[0, 1], [1, 2], [2, 3], [3, 4]])
    assert fabric_pp2[0][case]["bounds"] == bounds
    if case == "zbv":  # a model with parameters outside its stages: refused in one line
        assert re.search(r"pipeline_schedule='zbv' computes weight gradients of the stage modules only, and"
                         r" VisionTransformer has 2 parameters outside them .* use pipeline_schedule='1f1b'",
                         fabric_pp2[0]["vit-zbv-refused"])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tied-1f1b", "tied-zbv"])
def test_a_tied_lm_head_splits_over_the_first_and_last_stage_as_one_process_trains_it(fabric_pp2, case):
    """A Qwen2 with its head tied to the embedding (the first stage's embedding, the last stage's head; both on
    rank 0 under ZBV): built on the meta device, its copies start equal; loaded from an HF folder without
    ``lm_head.weight``; 3 steps clipped by the norm that counts the tie once, against one process within 1e-5,
    and the two copies bitwise equal after training."""
    results = [r["tied"] for r in fabric_pp2]
    placement = {"tied-1f1b": [[0], [1]], "tied-zbv": [[0, 3], [1, 2]]}[case]
    assert [r[case]["stages"] for r in results] == placement
    assert not results[0]["folder_has_head"]
    for result in results:
        run = result[case]
        assert min(result["ref_norms"]) > result["max_norm"]  # clipping was active every step
        assert run["norms"] == pytest.approx(result["ref_norms"], rel=1e-5)
        assert run["losses"] == pytest.approx(result["ref_losses"], rel=1e-5)
        assert run["initialised_equal"] and run["trained_equal"], run
        # 1F1B's checkpoint after 2 steps resumed under FSDP, and FSDP's under 1F1B: the third step of one process
        for moved in ("pp-to-fsdp", "fsdp-to-pp"):
            assert result[moved] == pytest.approx([result["ref_losses"][2], result["ref_norms"][2]], rel=1e-5)
    assert results[0][case]["state_diff"] <= 1e-5


# -- 3D: tensor x data parallel on 4 processes, pipeline x data parallel on 4 ---------------------------------
@pytest.mark.slow
def test_tp2_dp2_on_four_processes_trains_and_matches(tmp_path):
    from common import reference_losses

    results = run_dist("megatron_fabric.py", tmp_path, megatron(tensor_parallel_size=2), "train", nproc=4)
    expected = reference_losses(3, world_size=2)  # dp=2: the global batch of two data-parallel ranks
    for result in results:
        assert result["losses"] == pytest.approx(expected, abs=TOL)
        assert result["resumed"] == pytest.approx(result["losses"][2], abs=TOL)
    # TP layers split over tp and dp, the rest (embeddings, norms, head) over dp: each rank well under half
    assert max(r["local_params"] for r in results) < 0.4 * results[0]["total_params"]


@pytest.mark.slow
def test_pp2_dp2_vit_on_four_processes_matches(tmp_path):
    results = run_dist("megatron_trainer.py", tmp_path, megatron(pipeline_parallel_size=2, microbatches=2), "vit",
                       nproc=4)
    for result in results:
        assert result["losses"] == pytest.approx(result["ref_losses"], abs=TOL)
        assert result["val"] == pytest.approx(result["ref_val"], abs=TOL)
    assert results[0]["export_diff"] <= TOL


# -- model families beyond the tiny Llama: one launch per layout checks them all ----------------------------------
FAMILY_MODELS = ["gpt2", "gpt2-untied", "gpt2-userplan", "bert", "bert-userplan", "roberta", "qwen3", "qwen3-untied",
                 "qwen3-userplan", "llama-bias", "vit-qknorm", "t5"]
ENCODER_DECODER = "T5ForConditionalGeneration is an encoder-decoder model .* train it with disttrain_fsdp or"
REFUSED = {"tp": {"t5": ENCODER_DECODER},
           "pp": {"t5": ENCODER_DECODER}}
REL = 1e-4
TIED_REL = 1e-5  # a head tied to the embedding, split over the first and last stage: as exact as one process


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Each model trained 2 steps under tp=2 and under pp=2 (2 processes each), next to one process."""
    specs = {"tp": megatron(tensor_parallel_size=2), "pp": megatron(pipeline_parallel_size=2, microbatches=2)}
    models = {"tp": FAMILY_MODELS, "pp": [m for m in FAMILY_MODELS if not m.endswith("-userplan")]}
    return {layout: run_dist("families_run.py", tmp_path_factory.mktemp(f"families_{layout}"), spec,
                             *models[layout])[0] for layout, spec in specs.items()}


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "model"), [(layout, model) for layout in ("tp", "pp") for model in FAMILY_MODELS
                                               if layout == "tp" or not model.endswith("-userplan")])
def test_model_families_match_one_process_and_export_their_own_layout(families, layout, model):
    check_family(families[layout][model], layout, model, REFUSED)


def check_family(result: dict, layout: str, model: str, refused: dict) -> None:
    """One model of families_run.py under a layout: the strategy's one-line refusal, or one process's losses, full
    state, checkpoint, HF export and resumed step."""
    if model in refused[layout]:
        assert re.search(refused[layout][model], result["refused"]), result
        return
    assert "refused" not in result, result
    tied = layout == "pp" and model in ("gpt2", "qwen3", "gemma2")
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=TIED_REL if tied else REL)
    # The full state after training, gathered (export_full) and from the DCP checkpoint read offline, in the
    # library's own names and shapes (GPT-2's Conv1D [in, out], c_attn's q|k|v columns, timm's qkv rows).
    assert result["export_diff"][0] <= REL, result["export_diff"]
    assert result["ckpt_diff"][0] <= REL, result["ckpt_diff"]
    if not model.startswith(("vit", "deit")):  # `disttrain export --to hf`, loaded by HF's from_pretrained
        assert result["hf_logits_diff"] <= REL
    # the checkpoint loads back into the same layout (qkv slices and momentum reordered again): the next step
    assert result["resumed"] == pytest.approx(result["ref_resumed"], rel=REL)


def test_a_user_plan_applies_to_the_blocks_that_contain_its_paths():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers import BertConfig, BertModel

    from disttrain.parallel.split.tp import plan_blocks

    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                vocab_size=50))
    plan = {"attention.self.query": ColwiseParallel(), "attention.output.dense": RowwiseParallel()}
    # find_blocks gives BertEmbeddings too (HF's _no_split_modules); the plan's paths exist only in the layers
    assert [type(b).__name__ for b in plan_blocks(bert, plan)] == ["BertLayer", "BertLayer"]
    with pytest.raises(ValueError, match=r"tp_plan paths \['attention.self.qeury'\] do not all exist .* BertLayer: "):
        plan_blocks(bert, {"attention.self.qeury": ColwiseParallel()})
