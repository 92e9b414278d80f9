"""The planner's measured side: calibration files (cache, corrupt ones), the step-time model with measured links and
overlap, trials that pick the measured-fastest plan (`disttrain plan --trial`, `AutoStrategy(trial=True)`), and the
recipe's own settings. The fast tests use a synthetic calibration and a runner that stands in for the processes;
the slow one calibrates and tries plans on 2 CPU processes for real."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import lightning as L
import pytest

import disttrain
from conftest import run_python
from disttrain.config import read_recipe
from disttrain.planner import choose, estimate, hardware, model_spec
from disttrain.planner import calibrate as cal
from disttrain.planner.estimate import flops_per_sample
from disttrain.planner.steptime import breakdown

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/nlp/dialogue_tiny.yaml")


def synthetic(**links: cal.Link) -> cal.Calibration:
    fast = cal.Link(1e-4, 1e9)
    return cal.Calibration(host="test", device="cpu", world_size=2, backend="gloo", matmul=[[64, 64, 64, 2e10]],
                           memory_bw=5e9, optimizer_bw=1e9, links={op: links.get(op, fast) for op in cal.OPS},
                           overlap=0.5)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTTRAIN_CACHE", str(tmp_path))
    return tmp_path


def test_the_cache_file_round_trips_under_the_cache_dir(cache):
    path = cal.cache_path("cpu", 2)
    assert path.parent == cache / "calibration" and path.name.endswith("-cpu-2.json")
    cal.save(synthetic(), path)
    back = cal.cached("cpu", 2)
    assert back.links == synthetic().links and back.path == str(path)
    assert back.matmul_flops(60, 70, 64) == 2e10


@pytest.mark.parametrize("text", ["{not json", '{"version": 1, "host": "x"}', '{"version": 99}'])
def test_a_corrupt_cache_file_is_one_error_naming_it_and_the_fix(cache, text, capsys):
    from disttrain import cli

    path = cal.cache_path("cpu", 2)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(cal.CalibrationError, match="calibrate --force"):
        cal.cached("cpu", 2)
    assert cli.main(["plan", "--model", TINY, "--gpus", "2", "--gpu", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "delete it or run `disttrain calibrate --force`" in err[0], err


def two_nodes(**inter: cal.Link) -> cal.Calibration:
    """A calibration of 2 nodes x 2 processes: the synthetic links within a node, ``inter`` (else fast) between."""
    fast = cal.Link(1e-4, 1e9)
    return replace(synthetic(), world_size=4, nodes=2, inter_links={op: inter.get(op, fast) for op in cal.OPS})


def test_a_calibration_over_nodes_is_a_file_of_its_own_and_older_files_still_read(cache):
    path = cal.cache_path("cpu", 4, nodes=2)
    assert path.name.endswith("-cpu-2x2.json") and cal.cache_path("cpu", 4).name.endswith("-cpu-4.json")
    assert cal.cached("cpu", 4, nodes=2) is None
    cal.save(synthetic(), cal.cache_path("cpu", 4))
    assert cal.cached("cpu", 4, nodes=2).inter_links is None  # no calibration over nodes: this host's
    measured = two_nodes(all_reduce=cal.Link(2e-3, 1e8))
    cal.save(measured, path)
    back = cal.cached("cpu", 4, nodes=2)
    assert (back.inter_links, back.links, back.nodes, back.per_node) == (measured.inter_links, measured.links, 2, 2)
    assert cal.cached("cpu", 4).nodes == 1  # one host's file stays what it was
    # a file written before the links between nodes were measured: no such keys; read as one node's
    old = cal.cache_path("cpu", 2)
    data = synthetic().to_json()
    del data["nodes"]
    assert "inter_links" not in data
    old.write_text(json.dumps(data))
    assert (cal.load(old).inter_links, cal.load(old).nodes) == (None, 1)


@pytest.mark.parametrize("change, match", [
    ({"inter_links": None}, "2 node.* without inter-node links"),
    ({"nodes": 3}, "nodes 3 does not divide world_size 4"),
    ({"inter_links": {op: {"latency": 1e-4, "bandwidth": 0.0} for op in cal.OPS}}, "not a finite latency"),
    ({"links": {op: {"latency": float("nan"), "bandwidth": 1e9} for op in cal.OPS}}, "not a finite latency"),
])
def test_a_calibration_with_malformed_node_links_is_refused(cache, change, match):
    path = cal.cache_path("cpu", 4, nodes=2)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**two_nodes().to_json(), **change}))
    with pytest.raises(cal.CalibrationError, match=f"{match}.* calibrate --force"):
        cal.cached("cpu", 4, nodes=2)


def hsdp_and_fsdp(spec, hw) -> tuple:
    plan = choose(spec, 4, hw, micro_batch=2, precision="32-true", activation_checkpointing=False)
    hsdp = next(c.estimate for c in plan.candidates if c.estimate.dims.hybrid)
    fsdp = next(c.estimate for c in plan.candidates if c.label == "disttrain_fsdp")
    return hsdp, fsdp


def test_traffic_across_nodes_costs_the_links_measured_between_nodes():
    """2 nodes x 2 CPU processes: HSDP (shard=2 x 2) all-reduces its gradient shards between the nodes, one call per
    FSDP unit; its gathers stay within a node. FSDP over all 4 ranks gathers across the nodes."""
    from disttrain.planner.steptime import fsdp_units, step_time

    spec = model_spec(TINY)
    cpu = replace(hardware("cpu"), gpus_per_node=2)
    base = cal.hardware_from(two_nodes(), cpu)
    hsdp, fsdp = hsdp_and_fsdp(spec, base)
    assert hsdp.dims.dp_replicate == 2 and hsdp.comm["dp_replicate"] > 0
    slow = cal.Link(0.05, 1e6)
    reduce_across = cal.hardware_from(two_nodes(all_reduce=slow), cpu)
    grows = fsdp_units(spec) * (slow.latency - 1e-4) + hsdp.comm["dp_replicate"] * (1 / slow.bandwidth - 1 / 1e9)
    assert step_time(spec, hsdp, reduce_across) - step_time(spec, hsdp, base) == pytest.approx(grows, rel=1e-9)
    # HSDP's gathers use the links within a node, FSDP's over 4 ranks those between them
    gather_across = cal.hardware_from(two_nodes(all_gather=slow), cpu)
    assert step_time(spec, hsdp, gather_across) == pytest.approx(step_time(spec, hsdp, base))
    assert step_time(spec, fsdp, gather_across) > step_time(spec, fsdp, base) + 0.05
    gather_within = cal.hardware_from(replace(two_nodes(), links={**synthetic().links, "all_gather": slow}), cpu)
    assert step_time(spec, hsdp, gather_within) > step_time(spec, hsdp, base) + 0.05
    # FSDP's ring over all 4 ranks also passes the links within each node, with every rank's bytes
    assert step_time(spec, fsdp, gather_within) > step_time(spec, fsdp, base) + 0.05
    assert "between nodes as measured over 2 nodes" in choose(spec, 4, base, micro_batch=2).report()


def test_a_ring_over_every_rank_leaves_a_node_with_one_member_s_bytes():
    """Measured on 2 hosts x 2 processes (bench/multi_host.py): FSDP over all 4 ranks sends one rank's bytes per
    host per step, not two; the calibrated figure between nodes is a rank's share with both local ranks' groups busy.
    So FSDP's crossing traffic costs half its bytes at that figure (while the links within a node are faster), and
    HSDP's replicas (one member per node) their whole bytes; the presets keep their per-device figure."""
    from disttrain.planner.steptime import across_nodes, breakdown, node_share

    spec = model_spec(TINY)
    cpu = replace(hardware("cpu"), gpus_per_node=2)
    link = cal.Link(0.0, 1e6)  # between nodes: 1 MB/s per rank, no latency; within: 1 GB/s
    measured = cal.hardware_from(two_nodes(all_gather=link, reduce_scatter=link, all_reduce=link), cpu)
    hsdp, fsdp = hsdp_and_fsdp(spec, measured)
    assert (node_share(fsdp, measured), node_share(hsdp, measured), node_share(fsdp, cpu)) == (2, 2, 1)
    assert across_nodes(fsdp, measured) == pytest.approx(fsdp.comm["dp"] / 2)
    assert across_nodes(hsdp, measured) == pytest.approx(hsdp.comm["dp_replicate"])
    assert breakdown(spec, fsdp, measured).dp == pytest.approx(fsdp.comm["dp"] / 2 / 1e6, rel=1e-3)
    assert breakdown(spec, hsdp, measured).dp == pytest.approx(hsdp.comm["dp_replicate"] / 1e6, rel=2e-2)


def test_a_calibration_of_one_node_charges_traffic_across_nodes_at_the_preset_s_figures():
    """Without links measured between nodes, the crossing traffic costs the preset's latency and inter_node_bw (the
    ones ``disttrain plan --inter-node-gbps`` sets), not the links measured within one host."""
    from disttrain.planner.steptime import fsdp_units, step_time

    spec = model_spec(TINY)
    cpu = replace(hardware("cpu"), gpus_per_node=2)
    one_host = cal.hardware_from(synthetic(), cpu)
    hsdp, _ = hsdp_and_fsdp(spec, one_host)
    slower = cal.hardware_from(synthetic(), replace(cpu, inter_node_bw=1e6, latency=0.05))
    grows = fsdp_units(spec) * (0.05 - cpu.latency) + hsdp.comm["dp_replicate"] * (1 / 1e6 - 1 / cpu.inter_node_bw)
    assert step_time(spec, hsdp, slower) - step_time(spec, hsdp, one_host) == pytest.approx(grows, rel=1e-9)
    assert "between nodes not measured: 1 GB/s and 1000 us per collective (`disttrain calibrate --num-nodes`" in \
        choose(spec, 4, one_host, micro_batch=2).report()


def test_the_planner_finds_the_calibration_of_the_nodes_it_plans_for(cache):
    from disttrain.planner.hardware import detect, present

    cal.save(synthetic(), cal.cache_path("cpu", 4))
    cal.save(two_nodes(), cal.cache_path("cpu", 4, nodes=2))
    assert present("cpu", 4, gpus_per_node=2, measure=False).calibration.nodes == 2
    assert present("cpu", 4, measure=False).calibration.nodes == 1  # 4 processes on this host
    assert present("cpu", 4, gpus_per_node=1, measure=False).calibration.nodes == 1  # no 4x1 calibration: this host's
    import torch

    assert detect(torch.device("cpu"), 4, gpus_per_node=2).calibration.nodes == 2  # disttrain_auto at run time


def test_plan_on_gpus_here_stands_for_a_cluster_of_nodes_like_this_one(monkeypatch):
    import torch

    from disttrain.cli import here_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert here_device("cuda", 32, 8) == here_device(None, 8) == "cuda"
    assert here_device(None, 32) is None  # no --gpu: the default preset
    for per_node in (None, 16, 12):  # more GPUs per node than here, or not dividing the world
        with pytest.raises(ValueError, match="this machine has 8 GPUs, --gpus 32 asks for more; pass --gpus-per-node"):
            here_device("cuda", 32, per_node)


@pytest.mark.parametrize("argv, match", [
    (["--num-nodes", "2", "--node-rank", "2", "--main-address", "10.0.0.1"],
     "--node-rank 2 is not one of the --num-nodes 2 nodes' ranks: pass 0 to 1"),
    (["--num-nodes", "2", "--node-rank", "1"], "--num-nodes 2 needs --main-address"),
    (["--node-rank", "1"], "--node-rank 1 needs --num-nodes 2 or more"),
    (["--num-nodes", "0"], "--num-nodes 0 must be at least 1"),
    (["--num-nodes", "2", "--main-address", "10.0.0.1", "--main-port", "70000"], "--main-port 70000 is not a port"),
])
def test_calibrate_refuses_a_bad_node_layout_in_one_line(cache, capsys, argv, match):
    from disttrain import cli

    assert cli.main(["calibrate", "--devices", "1", *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("disttrain calibrate: error: ") and match in err[0], err


def test_the_link_fit_recovers_latency_and_bandwidth():
    points = [(b, 2e-3 + b / 5e8) for b in (1e4, 1e6, 4e6, 1.6e7)]
    link = cal._fit(points)
    assert link.latency == pytest.approx(2e-3) and link.bandwidth == pytest.approx(5e8)


def test_the_step_time_uses_the_measured_links_and_overlap():
    spec = model_spec(TINY)
    cpu = hardware("cpu")
    ddp, fsdp = (estimate(spec, s, 2, micro_batch=8, precision="32-true") for s in ("disttrain_ddp", "disttrain_fsdp"))
    quick = cal.hardware_from(synthetic(), cpu)
    slow_reduce = cal.hardware_from(synthetic(all_reduce=cal.Link(0.5, 1e6)), cpu)
    # DDP's all-reduce is measured slow: its step grows by about the calls x latency; FSDP's does not use it.
    assert breakdown(spec, ddp, slow_reduce).dp > breakdown(spec, ddp, quick).dp + 0.4
    assert breakdown(spec, fsdp, slow_reduce).total == pytest.approx(breakdown(spec, fsdp, quick).total)
    streams = replace(quick, overheads=replace(quick.overheads, overlaps=True))  # a device with streams (GPU)
    hidden = breakdown(spec, fsdp, replace(streams, overlap=1.0))
    exposed = breakdown(spec, fsdp, replace(streams, overlap=0.0))
    assert exposed.dp_exposed == pytest.approx(exposed.dp) and hidden.dp_exposed < exposed.dp_exposed
    # CPU processes have no streams to prefetch FSDP2's gathers on: each waits, whatever the measured overlap, and
    # sits between computations (two gathers and a reduce-scatter per unit, each costing the in-step extra)
    from disttrain.planner.steptime import fsdp_units

    inline = 3 * fsdp_units(spec) * quick.overheads.collective
    assert breakdown(spec, fsdp, replace(quick, overlap=1.0)).dp_exposed == pytest.approx(exposed.dp + inline)


def test_the_pipeline_bubble_follows_1f1b():
    spec = model_spec(TINY)
    a100 = hardware("A100-80GB")
    # Two stages, m microbatches: the ideal compute / (1 - (p-1)/(m+p-1)); m=2 idles 1/3, m=8 idles 1/9.
    two, eight = (breakdown(spec, estimate(spec, "disttrain_megatron", 2, micro_batch=8, pipeline_parallel_size=2,
                                           microbatches=m), a100).compute for m in (2, 8))
    assert two / eight == pytest.approx((8 / 9) / (2 / 3), rel=1e-6)


def test_a_pipeline_runs_at_the_pace_of_its_busiest_stage():
    """The engine's cost-balanced split of 4 equal blocks over 2 stages counts the LM head (vocabulary 2048 x width
    128 x 256 tokens) with the last stage: the busier stage sets the pace. A ViT's classifier head weighs nothing."""
    from disttrain.planner.steptime import stage_imbalance

    spec = model_spec(TINY)
    e = estimate(spec, "disttrain_megatron", 2, micro_batch=8, pipeline_parallel_size=2, microbatches=4)
    head = 2 * spec.vocab * spec.hidden * e.seq_len
    block = (flops_per_sample(spec, e.seq_len) / 3 - head) / spec.layers
    busiest = min(max(k * block, (4 - k) * block + head) for k in (1, 2, 3))  # the best split of 4 blocks in 2
    assert stage_imbalance(spec, e) == pytest.approx(busiest / ((4 * block + head) / 2)) and busiest > 2 * block
    vit = model_spec({"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 4, "num_heads": 4,
                      "num_classes": 10})
    assert stage_imbalance(vit, estimate(vit, "disttrain_megatron", 2, micro_batch=8,
                                         pipeline_parallel_size=2)) == pytest.approx(1.0, abs=0.01)


def test_the_framework_overhead_counts_each_engine_s_blocks():
    """Per block: plain under DDP, hooked under FSDP (per unit), DTensor under tensor parallelism with FSDP2's hooks
    on top (disttrain_megatron shards over its data-parallel ranks at any number); a pipeline stage runs its blocks
    once per microbatch over m + p - 1 slots. CPU processes add it to the compute, GPUs take the longer."""
    from disttrain.planner.hardware import Overheads

    spec = model_spec(TINY)  # 4 layers: 4 blocks + the ends as one more (FSDP: its units)
    own = Overheads(eager=1e-3, sharded=4e-3, tensor_parallel=9e-3, microbatch=2e-3, overlaps=False)
    cpu = replace(hardware("cpu"), overheads=own)
    parts = {s: breakdown(spec, estimate(spec, s, 2, micro_batch=8, precision="32-true", **o), cpu)
             for s, o in (("disttrain_ddp", {}), ("disttrain_fsdp", {}),
                          ("disttrain_megatron", {"tensor_parallel_size": 2}))}
    assert parts["disttrain_ddp"].overhead == pytest.approx(5e-3)
    # FSDP: one per unit, 7 of them (4 blocks, the sub-networks `model` (embeddings, final norm) and `lm_head`, root)
    assert parts["disttrain_fsdp"].overhead == pytest.approx(7 * 4e-3)
    # tensor parallelism: DTensor blocks under FSDP2's hooks (over the data-parallel ranks, one here)
    assert parts["disttrain_megatron"].overhead == pytest.approx(5 * (9e-3 + 4e-3 - 1e-3))
    pp = breakdown(spec, estimate(spec, "disttrain_megatron", 2, micro_batch=8, pipeline_parallel_size=2,
                                  microbatches=4), cpu)
    assert pp.overhead == pytest.approx((4 + 1) * (2 * 4e-3 + 2e-3))  # two FSDP-hooked blocks per stage, 5 slots
    ddp = parts["disttrain_ddp"]
    assert ddp.total == pytest.approx(ddp.compute + ddp.overhead + ddp.optimizer + ddp.dp_exposed + ddp.critical)
    gpu = breakdown(spec, estimate(spec, "disttrain_ddp", 2, micro_batch=8, precision="32-true"),
                    replace(cpu, overheads=replace(own, overlaps=True)))
    assert gpu.total == pytest.approx(max(gpu.compute, gpu.overhead) + gpu.optimizer + gpu.dp_exposed + gpu.critical)


def test_zero3_costs_its_measured_work_per_block_and_its_fetches_only_their_bytes():
    """DeepSpeed hooks every submodule and fetches each one's parameters in calls whose latency is all of them:
    ``overheads.zero3`` (measured with DeepSpeed itself) per block, and its data-parallel traffic at the bandwidth
    without a latency per call (counted in that figure). Without the figure (``zero3=0``), FSDP2's per-block hooks
    and the latency per call stand in. CPU processes have no streams: the gathers wait, not hidden."""
    from disttrain.planner.hardware import Overheads

    spec = model_spec(TINY)  # 4 blocks + the ends as one more
    e = estimate(spec, "disttrain_zero3", 2, micro_batch=8, precision="32-true")
    plain = Overheads(eager=1e-3, sharded=4e-3, tensor_parallel=0, microbatch=0, overlaps=False)
    measured = replace(plain, zero3=7e-3)
    before = breakdown(spec, e, replace(hardware("cpu"), overheads=plain, latency=1e-3))
    after = breakdown(spec, e, replace(hardware("cpu"), overheads=measured, latency=1e-3))
    assert before.overhead == pytest.approx(5 * 4e-3) and after.overhead == pytest.approx(5 * (1e-3 + 7e-3))
    calls = 5 * 4  # units x ZERO3_CALLS_PER_UNIT, each all-gathered twice (forward, backward), reduce-scattered once
    assert before.dp - after.dp == pytest.approx(3 * calls * 1e-3)
    assert after.dp_exposed == pytest.approx(after.dp) and after.dp > 0  # no stream to hide it on CPU


def test_a_collective_between_computations_costs_its_measured_extra_per_call():
    """Critical-path collectives (tensor-parallel all-reduces, pipeline sends) sit between computations and cost
    ``overheads.collective`` per call beyond their link's time. So do FSDP's gathers and reduce-scatters where the
    device has no streams to prefetch on (CPU processes: each unit waits for its own), and not where it has; DDP's
    buckets reduce on their own thread."""
    from disttrain.planner.hardware import Overheads
    from disttrain.planner.steptime import fsdp_units

    spec = model_spec(TINY)
    own = Overheads(eager=0, sharded=0, tensor_parallel=0, microbatch=0, overlaps=False)
    cpu = replace(hardware("cpu"), overheads=own)
    slow = replace(cpu, overheads=replace(own, collective=1e-3))
    for strategy, options, calls in (("disttrain_megatron", {"tensor_parallel_size": 2}, 4 * 4 * 2),
                                     ("disttrain_megatron", {"pipeline_parallel_size": 2, "microbatches": 4}, 2 * 4),
                                     ("disttrain_ddp", {}, 0), ("disttrain_fsdp", {}, 0)):
        e = estimate(spec, strategy, 2, micro_batch=8, precision="32-true", **options)
        base, extra = breakdown(spec, e, cpu), breakdown(spec, e, slow)
        assert extra.critical - base.critical == pytest.approx(calls * 1e-3), (strategy, options)
        assert extra.dp == base.dp
        inline = 3 * fsdp_units(spec) * 1e-3 if strategy == "disttrain_fsdp" else 0.0  # 2 gathers + 1 reduce a unit
        assert extra.dp_exposed - base.dp_exposed == pytest.approx(inline), strategy
    e = estimate(spec, "disttrain_fsdp", 2, micro_batch=8, precision="32-true")
    streams = [replace(cpu, overheads=replace(own, overlaps=True, collective=c)) for c in (0.0, 1e-3)]
    assert breakdown(spec, e, streams[0]).dp_exposed == breakdown(spec, e, streams[1]).dp_exposed


def test_the_optimizer_costs_each_parameter_tensor_it_steps():
    """Per parameter tensor a rank holds: plain under DDP, DTensor under FSDP and disttrain_megatron (FSDP2 over its
    data-parallel ranks even at dp=1; a pipeline stage its share), nothing under DeepSpeed's flat partitions; a spec
    built from a module or a config counts its tensors (a config's on the model built on the meta device)."""
    from disttrain.planner.hardware import Overheads
    from disttrain.planner.steptime import parameter_tensors
    from disttrain.planner.workload import build

    spec = model_spec(TINY)  # a Llama: 9 a block and 3 outside them
    assert parameter_tensors(spec) == 9 * 4 + 3
    vit = {"img_size": 32, "patch_size": 8, "num_classes": 10, "embed_dim": 64, "depth": 4, "num_heads": 4}
    assert parameter_tensors(model_spec(vit)) == sum(1 for _ in build(vit)[0].parameters()) == 12 * 4 + 8
    own = Overheads(eager=0, sharded=0, tensor_parallel=0, microbatch=0, overlaps=False)
    per_tensor = replace(own, optimizer_tensor=1e-4, optimizer_dtensor=1e-3)
    cpu = replace(hardware("cpu"), overheads=own)
    cases = (("disttrain_ddp", {}, 1e-4), ("disttrain_fsdp", {}, 1e-3), ("disttrain_zero3", {}, 0.0),
             ("disttrain_megatron", {"tensor_parallel_size": 2}, 1e-3),
             ("disttrain_megatron", {"pipeline_parallel_size": 2, "microbatches": 4}, 1e-3 / 2))
    for strategy, options, each in cases:
        e = estimate(spec, strategy, 2, micro_batch=8, precision="32-true", **options)
        added = breakdown(spec, e, replace(cpu, overheads=per_tensor)).optimizer - breakdown(spec, e, cpu).optimizer
        assert added == pytest.approx(39 * each), (strategy, options)

    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    assert parameter_tensors(model_spec(llama)) == sum(1 for _ in llama.parameters())


def test_at_run_time_a_pipeline_splits_the_loader_s_batch_or_is_left_out():
    """disttrain_auto's batch is each rank's DataLoader's: a pipeline gets microbatches that divide it (at least pp
    of them, for 1F1B) and is not a candidate when none do; the planner's own global batch splits as before."""
    def pipelines(plan):
        return {c.label: c.strategy_options().get("microbatches") for c in plan.candidates
                if c.estimate.dims.pp > 1 and not c.estimate.activation_checkpointing}

    assert pipelines(choose(TINY, 2, "cpu", micro_batch=2, loader_batch=True)) == {
        "disttrain_megatron tp=1 pp=2 dp=1": 2}
    assert pipelines(choose(TINY, 2, "cpu", micro_batch=6, loader_batch=True)) == {
        "disttrain_megatron tp=1 pp=2 dp=1": 3}
    assert pipelines(choose(TINY, 2, "cpu", micro_batch=1, loader_batch=True)) == {}
    assert pipelines(choose(TINY, 2, "cpu", micro_batch=1)) == {"disttrain_megatron tp=1 pp=2 dp=1": 2}


def test_a_model_its_family_cannot_pipeline_gets_no_pipeline_plans():
    import timm
    import torch

    with torch.device("meta"):
        deit, vit = (timm.create_model(name, img_size=32, num_classes=10, depth=2, embed_dim=64, num_heads=2)
                     for name in ("deit_tiny_distilled_patch16_224", "vit_tiny_patch16_224"))
    assert not model_spec(deit).extra["pipeline"] and model_spec(vit).extra["pipeline"]
    labels = {model: [c.label for c in choose(model, 2, "cpu", micro_batch=4).candidates] for model in (deit, vit)}
    assert not any("pp=2" in label for label in labels[deit]) and any("tp=2" in label for label in labels[deit])
    assert any("pp=2" in label for label in labels[vit])


def test_a_measured_block_efficiency_slows_the_compute_at_its_size():
    spec = model_spec(TINY)
    ddp = estimate(spec, "disttrain_ddp", 2, micro_batch=8, precision="32-true")
    full = cal.hardware_from(synthetic(), hardware("cpu"))
    half = cal.hardware_from(replace(synthetic(), blocks=[[1024, 128, 0.5], [8, 8, 0.01]]), hardware("cpu"))
    assert half.calibration.block_efficiency(8 * 128, 128) == 0.5  # the nearest size measured
    assert breakdown(spec, ddp, half).compute > 1.5 * breakdown(spec, ddp, full).compute


def test_the_calibration_s_overheads_replace_the_preset_s():
    measured = replace(synthetic(), overheads={"eager": 1e-3, "sharded": 2e-3, "tensor_parallel": 3e-3,
                                               "microbatch": 4e-3, "optimizer_dtensor": 5e-4})
    hw = cal.hardware_from(measured, hardware("cpu"))
    assert (hw.overheads.eager, hw.overheads.microbatch, hw.overheads.overlaps) == (1e-3, 4e-3, False)
    # a figure the file lacks keeps the preset's
    assert (hw.overheads.optimizer_dtensor, hw.overheads.optimizer_tensor) == \
        (5e-4, hardware("cpu").overheads.optimizer_tensor)
    assert cal.hardware_from(synthetic(), hardware("cpu")).overheads == hardware("cpu").overheads  # older files


@pytest.mark.parametrize("overheads", [{"eager": 1e-3},
                                       {"eager": 1, "sharded": 1, "tensor_parallel": 1, "microbatch": 1, "extra": 1}])
def test_a_calibration_with_unknown_overheads_is_refused(cache, overheads):
    path = cal.cache_path("cpu", 2)
    cal.save(replace(synthetic(), overheads=overheads), path)
    with pytest.raises(cal.CalibrationError, match="overheads .* calibrate --force"):
        cal.cached("cpu", 2)


def timed_row(spec, seconds, depths=(1, 4), micro_batch=4, seq_len=128) -> dict:
    return {"key": cal.model_key(spec), "name": spec.family, "micro_batch": micro_batch, "seq_len": seq_len,
            "depths": list(depths), "seconds": list(seconds)}


def test_a_model_s_own_timed_step_scales_its_compute_and_plain_overhead():
    from disttrain.planner.steptime import model_factor, profile_seconds

    spec = model_spec(TINY)  # 4 blocks
    hw = cal.hardware_from(synthetic(), hardware("cpu"))
    one = estimate(spec, "disttrain_ddp", 1, micro_batch=4, seq_len=128, precision="32-true")
    plain = breakdown(spec, one, hw)
    modelled = plain.compute + plain.overhead  # CPU processes compute and dispatch in turn
    # timed at 1 and 4 blocks: the line through them at the model's own 4 blocks is 3x the modelled time
    timed = replace(synthetic(), models=[timed_row(spec, (modelled, 3 * modelled))])
    slow = cal.hardware_from(timed, hardware("cpu"))
    assert profile_seconds(timed.models[0], 4) == pytest.approx(3 * modelled)
    assert profile_seconds(timed.models[0], 7) == pytest.approx(modelled + 6 * (2 * modelled / 3))
    assert model_factor(spec, slow) == pytest.approx(3.0) and model_factor(spec, hw) == 1.0
    for strategy, options in (("disttrain_ddp", {}), ("disttrain_fsdp", {}),
                              ("disttrain_megatron", {"pipeline_parallel_size": 2})):
        e = estimate(spec, strategy, 2, micro_batch=4, seq_len=128, precision="32-true", **options)
        base, scaled = breakdown(spec, e, hw), breakdown(spec, e, slow)
        assert scaled.compute == pytest.approx(3 * base.compute)
        # the plain block's share of the overhead triples, the engine's own part does not
        assert scaled.overhead > base.overhead and scaled.dp == base.dp and scaled.optimizer == base.optimizer
    # another model's timing (other widths) does not apply; the plan says whether this one was timed
    other = model_spec({**read_recipe(TINY)["model"], "hidden_size": 256})
    assert model_factor(other, slow) == 1.0
    assert "this model's own step timed there, 3.00x the modelled compute" in choose(TINY, 2, slow).report()
    assert "own step not timed (`disttrain calibrate --model CONFIG`" in choose(TINY, 2, hw).report()


def test_a_new_calibration_keeps_the_other_models_timings(cache):
    spec, other = model_spec(TINY), model_spec("configs/vision/vit_tiny.yaml")
    before = replace(synthetic(), models=[timed_row(spec, (1.0, 2.0)), timed_row(other, (3.0, 4.0))])
    kept = cal.kept_models(before, [timed_row(spec, (5.0, 6.0))])
    assert [row["seconds"] for row in kept] == [[3.0, 4.0], [5.0, 6.0]]  # re-timed: the new row replaces the old
    assert cal.kept_models(None, None) is None
    path = cal.cache_path("cpu", 2)
    cal.save(replace(synthetic(), models=kept), path)
    assert cal.cached("cpu", 2).model_profile(spec)["seconds"] == [5.0, 6.0]


@pytest.mark.parametrize("row", [{"seconds": [0.0, 1.0]}, {"seconds": [float("nan"), 1.0]}, {"depths": [1]},
                                 {"extra": 1}])
def test_a_calibration_with_a_malformed_model_timing_is_refused(cache, row):
    path = cal.cache_path("cpu", 2)
    cal.save(replace(synthetic(), models=[{**timed_row(model_spec(TINY), (1.0, 2.0)), **row}]), path)
    with pytest.raises(cal.CalibrationError, match="model timing .* calibrate --force"):
        cal.cached("cpu", 2)


FOUR_BLOCKS = [  # (a model mapping of 4 blocks, its blocks): Llama (by formulas), GPT-2 and an MoE (built), a ViT
    ({"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
      "num_attention_heads": 2}, lambda m: m.model.layers),
    ({"model_type": "gpt2", "vocab_size": 96, "n_embd": 32, "n_layer": 4, "n_head": 2}, lambda m: m.transformer.h),
    ({"model_type": "qwen2_moe", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
      "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "num_experts": 4,
      "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1},
     lambda m: m.model.layers),
    ({"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 4, "num_heads": 2, "num_classes": 10},
     lambda m: m.blocks)]


@pytest.mark.parametrize("mapping, blocks", FOUR_BLOCKS)
def test_the_calibration_builds_a_model_at_the_depths_it_times(mapping, blocks):
    from disttrain.planner.workload import build

    spec = model_spec(mapping)
    assert cal.model_depths(spec.layers) == (1, 4) and cal.model_depths(3) == (1, 3) and cal.model_depths(0) == (1,)
    for depth in (1, 4):
        model, _ = build(mapping, depth)
        assert len(blocks(model)) == depth
        assert cal.model_key(model_spec(mapping)) == cal.model_key(spec)  # the same key at any depth it is built


@pytest.mark.parametrize("mapping", [m for m, _ in FOUR_BLOCKS])
def test_the_step_time_counts_the_fsdp_units_the_engine_makes(mapping):
    """Each FSDP unit gathers and reduce-scatters on its own: the step time counts the units ``apply_fsdp`` makes
    (blocks, sub-networks such as the embeddings and the head, the root), not one per block and one for the rest."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from disttrain.parallel.split.fsdp import FSDPOptions, apply_fsdp
    from disttrain.planner.steptime import fsdp_units
    from disttrain.planner.workload import build
    from disttrain.simulate.fake import fake_world

    model, _ = build(mapping)
    with fake_world(0, 2):
        apply_fsdp(model, init_device_mesh("cpu", (2,)), FSDPOptions())
    made = sum(isinstance(m, FSDPModule) for m in model.modules())
    assert fsdp_units(model_spec(mapping)) == made


def fake_runner(times: dict):
    def run(model, c, devices, accelerator, steps):
        return times.get(c.label), "" if c.label in times else "not runnable here"

    return run


def test_a_trial_picks_the_fastest_measured_plan():
    from disttrain.planner.trial import trial

    plan = choose(TINY, 2, "cpu")
    first = plan.choice  # the estimate's choice is tried first, then the next fastest estimated
    second, third = [c for c in plan.ranked() if c is not first][:2]
    trial(plan, TINY, top=3, runner=fake_runner({first.label: 3.0, second.label: 1.0}))
    assert plan.choice is second and first.measured == 3.0 and third.measured is None
    report = plan.report()
    assert "measured s" in report.splitlines()[2]  # the table's head: predicted and measured side by side
    assert f"the fastest measured is {second.label} (the estimate preferred {first.label})" in report
    assert f"trial failed: {third.label}: not runnable here" in report


def test_a_trial_times_steps_of_milliseconds_for_half_a_second():
    """A few steps of a few milliseconds are mostly noise: the trial runner adds steps, at their median pace, until
    the timed ones take ``min_seconds`` in all (at most MAX_STEPS); long steps get none."""
    from disttrain.fabric.trial_run import MAX_STEPS, more_steps
    from disttrain.planner.trial import MIN_SECONDS

    assert MIN_SECONDS == 0.5
    assert more_steps([0.01] * 5, 0.5) == 45 and more_steps([0.01, 0.03, 0.01], 0.5) == 45
    assert more_steps([1.0] * 3, 0.5) == 0 and more_steps([0.01] * 5, 0.0) == 0
    assert more_steps([1e-6] * 3, 0.5) == MAX_STEPS - 3


def test_a_trial_needs_a_model_it_can_build():
    from disttrain.planner.trial import trial

    plan = choose(model_spec(TINY), 2, "cpu")
    with pytest.raises(ValueError, match="recipe YAML path or its `model:` dict"):
        trial(plan, model_spec(TINY), runner=fake_runner({}))


def test_auto_strategy_with_trial_becomes_the_measured_fastest(monkeypatch, cache):
    from disttrain.planner import trial as trials

    measured = {}

    def run(model, c, devices, accelerator, steps):  # each plan tried measured faster than the one before
        measured[c.label] = 5.0 - len(measured)
        return measured[c.label], ""

    monkeypatch.setattr(trials, "run_one", run)
    auto = disttrain.fabric.AutoStrategy(model=TINY, trial=True, trial_top=4, activation_checkpointing=False)
    fabric = L.Fabric(strategy=auto, accelerator="cpu", devices=2)
    choice = fabric.strategy.plan.choice
    assert len(measured) == 4 and choice.label == list(measured)[-1] != list(measured)[0]  # not the estimate's pick
    assert fabric.strategy.strategy_name == choice.estimate.strategy  # the strategy of the plan measured fastest
    assert choice.estimate.micro_batch == 8  # the recipe's train.micro_batch_size


@pytest.mark.slow
def test_calibrate_and_trial_on_two_cpu_processes(tmp_path):
    """`disttrain calibrate` measures for real, `plan --trial` runs the two best plans; the estimate's favourite is
    made slow by the test hook, so the other must win."""
    env = {"DISTTRAIN_CACHE": str(tmp_path)}
    model = tmp_path / "tiny.yaml"
    model.write_text(json.dumps({"model": {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
                                           "num_hidden_layers": 2, "num_attention_heads": 4,
                                           "num_key_value_heads": 2, "max_position_embeddings": 32},
                                 "train": {"micro_batch_size": 2, "precision": "32-true",
                                           "activation_checkpointing": False}, "data": {"seq_len": 32}}))
    out = run_python("-m", "disttrain.cli", "calibrate", "--devices", "2", "--model", str(model), env=env,
                     timeout=600)
    assert out.returncode == 0, out.stderr
    assert "model llama forward + backward of 2 x 32: 1 blocks" in out.stdout, out.stdout
    calibration = cal.load(next((tmp_path / "calibration").glob("*-cpu-2.json")))
    timed = calibration.model_profile(model_spec(str(model)))  # the model's own step, at 1 and its 2 blocks
    assert timed["depths"] == [1, 2] and 0 < timed["seconds"][0] < 1
    assert (timed["micro_batch"], timed["seq_len"]) == (2, 32)
    assert set(calibration.links) == set(cal.OPS) and all(l.bandwidth > 0 for l in calibration.links.values())
    framework = calibration.overheads  # each measured, and DTensor dispatch costs more than a plain block's
    assert set(framework) == cal.OVERHEADS | cal.LATER_OVERHEADS and all(0 <= v < 1 for v in framework.values())
    assert 0 < framework["eager"] < framework["tensor_parallel"]
    assert 0 < framework["optimizer_tensor"] < framework["optimizer_dtensor"]
    # DeepSpeed's hooks on every submodule and its fetches weigh more than FSDP2's hooks on a unit
    assert framework["zero3"] > framework["sharded"] - framework["eager"]
    import torch

    from disttrain.planner.hardware import detect

    here = cal.hardware_from(calibration, detect(torch.device("cpu"), 2, calibrated=False))  # what the CLI plans for
    slow = choose(str(model), 2, here).choice.label  # tried first
    out = run_python("-m", "disttrain.cli", "plan", "--model", str(model), "--gpus", "2", "--gpu", "cpu", "--trial",
                     "--trial-top", "2", "--trial-steps", "1", env={**env, "DISTTRAIN_TRIAL_DELAY": f"{slow}=5"},
                     timeout=900)
    assert out.returncode == 0, out.stderr
    rows = [line.rsplit(None, 1) for line in out.stdout.splitlines() if line.startswith("disttrain_")]
    measured = {line[:46].strip(): float(value) for line, value in rows if value != "-"}
    assert len(measured) == 2 and measured[slow] >= 5, out.stdout  # predicted and measured side by side
    assert f"recommendation: {min(measured, key=measured.get)}" in out.stdout, out.stdout
    assert f"the estimate preferred {slow}" in out.stdout


def _shaped_nodes(tag: str) -> tuple[list[str], list[str], list[str]] | None:
    """Two network namespaces joined by a veth pair shaped to 200 Mbit/s each way (tc tbf): (namespaces, veth
    ends, addresses), or None where this machine cannot make them (not root, no ip/tc, or the kernel refuses)."""
    import os
    import shutil
    import subprocess

    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return None
    spaces, ends, addresses = [f"{tag}n0", f"{tag}n1"], [f"{tag}v0", f"{tag}v1"], ["10.77.0.1", "10.77.0.2"]
    try:
        for space in spaces:
            subprocess.run(["ip", "netns", "add", space], check=True, capture_output=True)
        subprocess.run(["ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1]], check=True,
                       capture_output=True)
        for space, end, address in zip(spaces, ends, addresses):
            for argv in (["ip", "link", "set", end, "netns", space],
                         ["ip", "-n", space, "addr", "add", f"{address}/24", "dev", end],
                         ["ip", "-n", space, "link", "set", end, "up"], ["ip", "-n", space, "link", "set", "lo", "up"],
                         ["tc", "-n", space, "qdisc", "add", "dev", end, "root", "tbf", "rate", "200mbit", "burst",
                          "32kbit", "latency", "50ms"]):
                subprocess.run(argv, check=True, capture_output=True)
    except subprocess.CalledProcessError:
        _remove_namespaces(spaces)
        return None
    return spaces, ends, addresses


def _remove_namespaces(spaces: list[str]) -> None:
    import subprocess

    for space in spaces:
        subprocess.run(["ip", "netns", "del", space], capture_output=True)  # takes its end of the veth along


@pytest.mark.slow
def test_calibrate_over_two_nodes_measures_both_links(tmp_path):
    """Two `disttrain calibrate --num-nodes 2 --quick` launches of 2 processes each, each node with a cache of its
    own: both write the same calibration (rank 0's), with the links within a node and between nodes. Where the test
    may make network namespaces (root, ip, tc), the nodes are two of them joined by a veth pair shaped to 200 Mbit/s,
    and the links between nodes are measured at that rate (the 2 processes of a node share it), those within a node
    (over its own loopback) many times faster; elsewhere both nodes are on 127.0.0.1. Then the planner, given a copy
    with a slow all-reduce between the nodes, charges HSDP's replicas' all-reduce at that link."""
    import os
    import shutil
    import subprocess
    import sys

    from conftest import ROOT, child_env, free_port
    from disttrain.planner.hardware import present
    from disttrain.planner.steptime import fsdp_units, step_time

    shaped = _shaped_nodes(f"dtc{os.getpid() % 100000}")
    rate = 200e6 / 8  # bytes/s the shaped veth carries each way
    port = free_port()
    try:
        procs = []
        for node in (0, 1):
            env = {**child_env(), "DISTTRAIN_CACHE": str(tmp_path / f"node{node}")}
            prefix, address = [], "127.0.0.1"
            if shaped:
                spaces, ends, addresses = shaped
                prefix, address = ["ip", "netns", "exec", spaces[node]], addresses[0]
                env["GLOO_SOCKET_IFNAME"] = ends[node]
            procs.append(subprocess.Popen(
                [*prefix, sys.executable, "-m", "disttrain.cli", "calibrate", "--devices", "2", "--num-nodes", "2",
                 "--node-rank", str(node), "--main-address", address, "--main-port", str(port), "--quick"],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = []
        for proc in procs:
            out, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, err[-4000:]
            outs.append(out)
    finally:
        if shaped:
            _remove_namespaces(shaped[0])
    assert "within a node (2 processes):" in outs[0] and "between nodes (2):" in outs[0], outs[0]
    files = [next((tmp_path / f"node{node}" / "calibration").glob("*-cpu-2x2.json")) for node in (0, 1)]
    c = cal.load(files[0])
    assert cal.load(files[1]).to_json() == c.to_json()  # rank 0's figures on every node
    assert (c.world_size, c.nodes, c.per_node) == (4, 2, 2)
    for links in (c.links, c.inter_links):
        assert set(links) == set(cal.OPS)
        assert all(0 <= link.latency < 1 and 0 < link.bandwidth < float("inf") for link in links.values()), links
    if shaped:
        assert all(link.bandwidth < rate for link in c.inter_links.values()), c.inter_links
        between = 2 * c.inter_links["all_reduce"].bandwidth  # per rank: the 2 ranks of a node share its link
        assert 0.5 * rate < between < 1.5 * rate, between / rate  # the link's rate, not a bound below it
        assert c.links["all_reduce"].bandwidth > 5 * between / 2, (c.links, c.inter_links)

    # the same calibration with a slow all-reduce between the nodes: HSDP's step grows by its replicas' traffic
    slow = cal.Link(0.05, 1e6)
    cache = tmp_path / "planner"
    shutil.copytree(tmp_path / "node0", cache)
    spec = model_spec(TINY)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DISTTRAIN_CACHE", str(cache))
        measured = present("cpu", 4, gpus_per_node=2, measure=False)
        cal.save(replace(c, inter_links={**c.inter_links, "all_reduce": slow}), cache / "calibration" / files[0].name)
        slowed = present("cpu", 4, gpus_per_node=2, measure=False)
    assert measured.calibration.inter_links == c.inter_links and slowed.calibration.inter_links["all_reduce"] == slow
    hsdp, _ = hsdp_and_fsdp(spec, measured)
    was = c.inter_links["all_reduce"]
    grows = fsdp_units(spec) * (slow.latency - was.latency) + \
        hsdp.comm["dp_replicate"] * (1 / slow.bandwidth - 1 / was.bandwidth)
    assert step_time(spec, hsdp, slowed) - step_time(spec, hsdp, measured) == pytest.approx(grows, rel=1e-9)
