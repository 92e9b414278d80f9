"""Registration of the name table in both Lightning registries, and strategy option errors."""

import importlib

import pytest
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

import disttrain
from disttrain.names import adapters
from disttrain.parallel.registry import STRATEGIES

NAMES = [row.name for row in STRATEGIES]


@pytest.mark.parametrize("registry,package", [(StrategyRegistry, disttrain.strategies),
                                              (STRATEGY_REGISTRY, disttrain.fabric)])
def test_every_name_is_registered_in_both_registries(registry, package):
    for row in STRATEGIES:
        cls = adapters(row).trainer if registry is StrategyRegistry else adapters(row).fabric
        assert registry[row.name]["strategy"] is cls is getattr(package, cls.__name__)
        assert registry[row.name]["init_params"] == row.defaults


def test_importing_twice_is_harmless():
    before = (dict(StrategyRegistry), dict(STRATEGY_REGISTRY))
    importlib.reload(disttrain)
    disttrain.register_strategies()
    assert set(StrategyRegistry) == set(before[0]) and set(STRATEGY_REGISTRY) == set(before[1])


DESIGNED = ("disttrain_ddp", "disttrain_fsdp", "disttrain_fsdp_offload", "disttrain_zero3", "disttrain_zero3_offload",
            "disttrain_zero1", "disttrain_zero2", "disttrain_zero2_offload", "disttrain_megatron", "disttrain_recsys",
            "disttrain_auto")


def test_names_not_implemented_are_not_registered():
    for name in set(DESIGNED) - set(NAMES):  # only rows of the name table are registered
        assert name not in StrategyRegistry and name not in STRATEGY_REGISTRY
    assert set(NAMES) <= set(DESIGNED)


def test_offload_name_sets_cpu_offload():
    assert StrategyRegistry.get("disttrain_fsdp_offload").engine.options.cpu_offload
    assert not StrategyRegistry.get("disttrain_fsdp").engine.options.cpu_offload


@pytest.mark.parametrize("cls", [disttrain.strategies.FSDPStrategy, disttrain.fabric.FSDPStrategy])
def test_unknown_fsdp_option_names_the_value_and_the_fix(cls):
    with pytest.raises(TypeError, match=r"unknown option 'activation_checkpoint'.*did you mean "
                                        r"'activation_checkpointing'\?.*valid options are: wrap_classes"):
        cls(activation_checkpoint=True)


@pytest.mark.parametrize("cls", [disttrain.strategies.DDPStrategy, disttrain.fabric.DDPStrategy])
def test_ddp_options(cls):
    with pytest.raises(TypeError, match="unknown option 'compression'.*gradient_compression"):
        cls(compression="fp16")
    with pytest.raises(ValueError, match=r"gradient_compression='int4' is not known; choose None or one of fp16"):
        cls(gradient_compression="int4")
    assert cls(gradient_compression="powersgd").engine.options.gradient_compression == "powersgd"


def test_trainer_accepts_the_names_on_cpu():
    import lightning as L

    trainer = L.Trainer(strategy="disttrain_fsdp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, disttrain.strategies.FSDPStrategy)
    fabric = L.Fabric(strategy="disttrain_fsdp_offload", accelerator="cpu", devices=2)
    assert isinstance(fabric.strategy, disttrain.fabric.FSDPStrategy)
    assert fabric.strategy.engine.options.cpu_offload


def test_mixed_precision_plugin_is_swapped_for_fsdp2():
    import lightning as L

    trainer = L.Trainer(strategy="disttrain_fsdp", accelerator="cpu", devices=2, precision="bf16-mixed",
                        logger=False)
    assert type(trainer.strategy.precision_plugin).__name__ == "FSDP2MixedPrecision"
    fabric = L.Fabric(strategy="disttrain_fsdp", accelerator="cpu", devices=2, precision="bf16-mixed")
    assert isinstance(fabric.strategy.precision, disttrain.fabric.FSDP2MixedPrecision)
    with fabric.autocast():  # FSDP2 casts per block; no global autocast
        import torch
        assert not torch.is_autocast_enabled("cpu")
