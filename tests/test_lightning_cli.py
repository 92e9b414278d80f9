"""LightningCLI configures a disttrain strategy from YAML (``class_path`` + ``init_args``) and from the command line
(``--trainer.strategy.init_args.NAME``), because each strategy class's signature is its options: two runs on 2 CPU
processes, their options checked where the engine reads them and their losses against one process."""

from __future__ import annotations

import pytest
import yaml
from conftest import run_dist

from common import reference_losses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 3


def config(tmp_path, class_path: str, init_args: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"trainer": {
        "accelerator": "cpu", "devices": 2, "max_steps": STEPS, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False,
        "strategy": {"class_path": class_path, "init_args": init_args}}}))
    return str(path)


def test_fsdp_options_from_yaml_and_the_command_line_reach_the_engine(tmp_path):
    yaml_file = config(tmp_path, "disttrain.strategies.FSDPStrategy",
                       {"activation_checkpointing": True, "reshard_after_forward": False})
    results = run_dist("lightning_cli.py", tmp_path, yaml_file, "--trainer.strategy.init_args.broadcast_buffers=false")
    expected = reference_losses(STEPS, world_size=2)  # the global batch of 2 data-parallel ranks
    for result in results:
        assert result["strategy"] == "disttrain.strategies.fsdp.FSDPStrategy"
        options = result["options"]
        assert options["activation_checkpointing"] is True and options["reshard_after_forward"] is False
        assert options["broadcast_buffers"] is False  # from the command line
        assert options["cpu_offload"] is False  # what neither gave keeps the dataclass default
        assert result["wrapped_blocks"] == 2  # each of the tiny Llama's 2 decoder layers recomputed in backward
        assert result["degrees"] == {"dp_shard": 2}
        assert result["losses"] == pytest.approx(expected, rel=1e-5)


def test_megatron_tensor_parallel_size_from_yaml_reaches_the_engine(tmp_path):
    yaml_file = config(tmp_path, "disttrain.strategies.MegatronStrategy", {"tensor_parallel_size": 2})
    results = run_dist("lightning_cli.py", tmp_path, yaml_file)
    expected = reference_losses(STEPS, world_size=1)  # tp=2 on 2 processes: one data-parallel rank
    for result in results:
        assert result["strategy"] == "disttrain.strategies.megatron.MegatronStrategy"
        assert result["options"]["tensor_parallel_size"] == 2
        assert result["degrees"] == {"dp_shard": 1, "tp": 2}
        assert result["losses"] == pytest.approx(expected, abs=1e-5)
