"""Moving over from Lightning's own strategies (docs/migrating.md): the checkpoints they wrote, resumed under disttrain
strategies, and what a migrating module or option meets.

The launched tests (tests/dist/lightning_resume.py, 2 CPU processes, fp32) have Lightning write each kind of
checkpoint with its own ``save_checkpoint`` / ``fabric.save`` and continue its own checkpoint as the reference
(``ddp`` its file; its FSDPStrategy its full file), and resume every kind under disttrain strategies: the losses of the
steps after the resume must equal the reference's. ``disttrain_megatron`` with tensor_parallel_size=2 on 2 processes
has one data-parallel rank, so its reference is the same continuation in one process here. The in-process tests build
the two layouts by hand (the keys Lightning writes, cited in disttrain/checkpoint_loading.py) and check what is
refused: other parameter orders, unsafe pickles, a model sharded before set-up, Lightning's option names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from common import global_batch, tiny_llama
from disttrain.checkpoint_loading import open_lightning_checkpoint, parameter_order
from disttrain.parallel.checkpoint.integrity import CheckpointError, UnverifiedCheckpointWarning
from disttrain.parallel.checkpoint.io import load_sharded, model_state, optimizer_state, save_sharded

pytestmark = pytest.mark.timeout(1200)
TOL = 1e-5
TP2 = "disttrain_megatron:tensor_parallel_size=2"


def close(a, b, tol: float = TOL) -> bool:
    return isinstance(a, list) and len(a) == len(b) == 2 and all(abs(x - y) <= tol for x, y in zip(a, b))


def continued_in_one_process(ckpt: Path, world_size: int) -> list[float]:
    """Steps 4 and 5 from Lightning's ddp file, in one plain process, on the global batches of ``world_size``
    data-parallel ranks: what Lightning's own single-device strategy does with the file."""
    saved = torch.load(ckpt, weights_only=True)
    model = tiny_llama()
    model.load_state_dict({k.removeprefix("model."): v for k, v in saved["state_dict"].items()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.load_state_dict(saved["optimizer_states"][0])
    losses = []
    for step in (3, 4):
        ids = global_batch(step, world_size)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lightning_resume")
    runs = run_dist("lightning_resume.py", folder, "trainer", timeout=900)[0]["runs"]
    return runs, continued_in_one_process(folder / "ddp.ckpt", world_size=1)


# -- launched: the Trainer -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_lightning_ddp_file_resumes_under_fsdp_zero3_and_tensor_parallel(trainer_runs):
    runs, one_rank = trainer_runs
    reference = runs["ddp"]["ddp"]
    assert close(runs["ddp"]["disttrain_fsdp"], reference), runs["ddp"]
    assert close(runs["ddp"]["disttrain_zero3"], reference), runs["ddp"]
    assert close(runs["ddp"][TP2], one_rank), (runs["ddp"][TP2], one_rank)


@pytest.mark.slow
def test_lightning_fsdp_and_model_parallel_folders_resume(trainer_runs):
    runs, one_rank = trainer_runs
    reference = runs["ddp"]["ddp"]
    for strategy in ("disttrain_fsdp", "disttrain_zero3", "disttrain_ddp"):
        assert close(runs["fsdp"][strategy], reference), (strategy, runs["fsdp"])
    assert close(runs["mp"]["disttrain_fsdp"], reference), runs["mp"]
    assert close(runs["mp"][TP2], one_rank), (runs["mp"][TP2], one_rank)


@pytest.mark.slow
def test_lightning_fsdp_and_model_parallel_single_files_resume(trainer_runs):
    """FSDPStrategy(state_dict_type="full") on CPU saves exp_avg moments that differ from those it trained with
    (its step-5 loss differs from ddp's); disttrain_fsdp continues the file exactly as Lightning's FSDPStrategy does."""
    runs, _ = trainer_runs
    assert close(runs["fsdp-full"]["disttrain_fsdp"], runs["fsdp-full"]["fsdp"]), runs["fsdp-full"]
    assert close(runs["mp-full"]["disttrain_fsdp"], runs["ddp"]["ddp"]), runs["mp-full"]


@pytest.mark.slow
def test_deepspeed_folder_resumes_under_zero3_and_elsewhere_names_the_ways(trainer_runs):
    runs, _ = trainer_runs
    assert close(runs["deepspeed"]["disttrain_zero3"], runs["ddp"]["ddp"]), runs["deepspeed"]
    refused = runs["deepspeed"]["disttrain_fsdp"]
    assert refused.startswith("CheckpointError: ") and "\n" not in refused, refused
    assert "is a DeepSpeed folder" in refused and "disttrain_zero3 with the same number of processes" in refused
    assert "convert_zero_checkpoint_to_fp32_state_dict" in refused


@pytest.mark.slow
def test_what_cannot_resume_is_one_line_naming_the_way(trainer_runs):
    runs, _ = trainer_runs
    weights = runs["deepspeed-weights"]["disttrain_fsdp"]  # convert_zero_checkpoint_to_fp32_state_dict's file
    assert "holds no optimizer state" in weights and "load_from_checkpoint" in weights and "\n" not in weights
    stage = runs["ddp"]["disttrain_megatron:pipeline_parallel_size=2"]
    assert "numbers 21 parameters, this run's optimizer holds" in stage and "pipeline_parallel_size=1" in stage
    assert "\n" not in stage


@pytest.mark.slow
def test_a_module_that_shards_itself_is_refused_with_the_fix(trainer_runs):
    runs = trainer_runs[0]["sharded-in-configure-model"]
    assert runs["mesh names"] == ("KeyError: \"Invalid mesh_dim_names ('data_parallel',) specified. Valid"
                                  " mesh_dim_names are ['dp_shard'].\""), runs  # self.device_mesh["data_parallel"]
    refused = runs["disttrain_fsdp"]
    assert refused.startswith("ValueError: disttrain_fsdp: the model is already sharded (fully_shard was applied to"
                              " 'model.model.layers.0'"), refused
    assert "remove the fully_shard / parallelize_module calls" in refused and "\n" not in refused


# -- launched: Fabric ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fabric_saves_of_lightning_strategies_resume(tmp_path):
    runs = run_dist("lightning_resume.py", tmp_path, "fabric", timeout=900)[0]["runs"]
    reference = runs["ddp"]["ddp"]
    assert close(runs["ddp"]["disttrain_fsdp"], reference), runs
    assert close(runs["ddp"]["disttrain_zero3"], reference), runs
    assert close(runs["mp"]["disttrain_fsdp"], reference), runs


# -- in one process: the two layouts, and what is refused ------------------------------------------------------
class Wrapped(torch.nn.Module):
    """A LightningModule's names: the model under ``model.``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_llama()


def trained() -> tuple[Wrapped, torch.optim.Optimizer]:
    module = Wrapped()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    ids = global_batch(0, 2)
    module.model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return module, optimizer


def opened(path: Path, module: torch.nn.Module, optimizer, trainer: bool = True, weights_only: bool = True):
    keys = ("state_dict", "optimizer_0") if trainer else ("model", "optimizer")

    def order(key: str):
        return parameter_order(optimizer_state(module, optimizer), model_state(module))

    return open_lightning_checkpoint(path, keys[0], [keys[1]], trainer, order, "disttrain_fsdp", weights_only)


def restored_equal(saved: tuple[Wrapped, torch.optim.Optimizer], path: Path) -> None:
    """A fresh module and optimizer restored from ``path`` (Lightning's) hold the saved weights and moments."""
    module = Wrapped()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    metadata = load_sharded(path, {"state_dict": module, "optimizer_0": optimizer}, module,
                            source=opened(path, module, optimizer))
    assert metadata["global_step"] == 1
    for (name, mine), theirs in zip(module.state_dict().items(), saved[0].state_dict().values()):
        assert torch.equal(mine, theirs), name
    for mine, theirs in zip(optimizer.state.values(), saved[1].state.values()):
        assert all(torch.equal(mine[k], theirs[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert optimizer.param_groups[0]["lr"] == 1e-2 and len(optimizer.state) == len(saved[1].state)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_lightning_folder_is_read_in_the_one_layout(tmp_path):
    """The Trainer FSDPStrategy's layout: the model under "model", each optimizer in torch's nested form
    (lightning/pytorch/strategies/fsdp.py, save_checkpoint), the rest in meta.pt."""
    saved = trained()
    nested = get_optimizer_state_dict(saved[0], saved[1])
    path = tmp_path / "lightning.ckpt"
    dcp.save({"model": saved[0].state_dict(), "optimizer_0": nested}, checkpoint_id=path, no_dist=True)
    torch.save({"global_step": 1, "loops": {}, "pytorch-lightning_version": "2.6.6"}, path / "meta.pt")
    with pytest.warns(UnverifiedCheckpointWarning, match="written by Lightning's own strategy"):
        restored_equal(saved, path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_lightning_folder_safe_loading_refuses_names_weights_only(tmp_path):
    saved = trained()
    path = tmp_path / "lightning.ckpt"
    dcp.save({"model": saved[0].state_dict()}, checkpoint_id=path, no_dist=True)
    torch.save({"global_step": 1, "hyper_parameters": {"data": Path("/data")}}, path / "meta.pt")
    with pytest.warns(UnverifiedCheckpointWarning), pytest.raises(CheckpointError, match="holds objects that safe"
                                                                  " loading refuses .*weights_only=False"):
        opened(path, saved[0], saved[1])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_lightning_file_is_read_in_the_one_layout(tmp_path):
    saved = trained()
    path = tmp_path / "ddp.ckpt"
    torch.save({"state_dict": saved[0].state_dict(), "optimizer_states": [saved[1].state_dict()], "global_step": 1,
                "loops": {}}, path)
    restored_equal(saved, path)


def test_another_parameter_order_is_refused_not_misplaced(tmp_path):
    saved = trained()
    path = tmp_path / "ddp.ckpt"
    torch.save({"state_dict": saved[0].state_dict(), "optimizer_states": [saved[1].state_dict()]}, path)
    module = Wrapped()
    reordered = torch.optim.AdamW(list(module.parameters())[::-1], lr=1e-2)
    with pytest.raises(CheckpointError, match=r"optimizer_0's exp_avg of parameter 1 has shape \[64, 64\], but this"
                                              r" run's parameter 1 \(model.model.norm.weight\) has shape \[64\]: the"
                                              " optimizer lists its parameters in another order"):
        opened(path, module, reordered)
    fewer = torch.optim.AdamW(list(module.parameters())[1:], lr=1e-2)
    with pytest.raises(CheckpointError, match="numbers 21 parameters, this run's optimizer holds 20"):
        opened(path, module, fewer)


def test_a_file_safe_loading_refuses_names_weights_only(tmp_path):
    saved = trained()
    path = tmp_path / "ddp.ckpt"
    torch.save({"state_dict": saved[0].state_dict(), "optimizer_states": [saved[1].state_dict()],
                "hyper_parameters": {"data": Path("/data")}}, path)
    with pytest.raises(CheckpointError, match=r"holds objects that safe loading refuses .*load it with"
                                              r" weights_only=False \(trainer.fit\(..., weights_only=False\)\)$"):
        opened(path, saved[0], saved[1])
    assert opened(path, saved[0], saved[1], weights_only=False) is not None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_disttrain_checkpoints_are_left_to_their_own_load(tmp_path):
    saved = trained()
    folder = save_sharded(tmp_path / "own", {"state_dict": model_state(saved[0])}, {"global_step": 1})
    assert opened(folder, saved[0], saved[1]) is None
    own_file = tmp_path / "own.ckpt"  # save_distributed_checkpoint=False: optimizers by key, already by name
    torch.save({"state_dict": saved[0].state_dict(), "optimizer_0": optimizer_state(saved[0], saved[1]),
                "global_step": 1}, own_file)
    assert opened(own_file, saved[0], saved[1]) is None
    fabric_file = tmp_path / "fabric.ckpt"  # Fabric under disttrain_fsdp(save_distributed_checkpoint=False)
    torch.save({"model": saved[0].state_dict(), "optimizer": optimizer_state(saved[0], saved[1], full=True)},
               fabric_file)
    assert opened(fabric_file, saved[0], saved[1], trainer=False) is None
    lightning_fabric = tmp_path / "lightning-fabric.ckpt"  # Fabric's ddp: the optimizer's own state_dict()
    torch.save({"model": saved[0].state_dict(), "optimizer": saved[1].state_dict(), "step": 1}, lightning_fabric)
    assert opened(lightning_fabric, saved[0], saved[1], trainer=False).metadata == {"step": 1}


def test_a_model_sharded_before_setup_is_refused_in_one_line():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from disttrain.parallel.engines.base import refuse_user_sharding

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    module = Wrapped()
    refuse_user_sharding(module, "disttrain_zero3")  # a plain model passes
    fully_shard(module.model.model.layers[1])
    with pytest.raises(ValueError, match=r"^disttrain_zero3: the model is already sharded \(fully_shard was applied"
                                         r" to 'model.model.layers.1', as Lightning's ModelParallelStrategy"):
        refuse_user_sharding(module, "disttrain_zero3")


def test_lightning_option_names_say_what_to_pass_instead():
    import disttrain

    cases = [(disttrain.strategies.FSDPStrategy, {"sharding_strategy": "SHARD_GRAD_OP"},
              "SHARD_GRAD_OP is reshard_after_forward=False"),
             (disttrain.fabric.FSDPStrategy, {"auto_wrap_policy": None}, "wrap_classes= the block classes"),
             (disttrain.strategies.ZeroStrategy, {"reduce_bucket_size": 5e8},
              "config={'zero_optimization': {'reduce_bucket_size': ...}}"),
             (disttrain.strategies.ZeroStrategy, {"loss_scale": 0}, "config={'fp16': {'loss_scale': ...}}"),
             (disttrain.strategies.MegatronStrategy, {"data_parallel_size": 2},
              "data parallel takes the ranks the other sizes leave")]
    for cls, options, said in cases:
        with pytest.raises(TypeError, match=f"unknown option '{next(iter(options))}' for strategy 'disttrain_.*'; as"
                                            f" Lightning's option, here: .*{re.escape(said)}.* \\(docs/migrating.md\\);"
                                            " valid options are: "):
            cls(**options)
    with pytest.raises(ValueError, match=r"offload_optimizer=True is not a place to offload to; choose None, 'cpu' or"
                                         r" 'nvme' \(Lightning's True is 'cpu' here\)"):
        disttrain.strategies.ZeroStrategy(offload_optimizer=True)
