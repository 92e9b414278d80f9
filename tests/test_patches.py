"""Each patch of :mod:`disttrain.patches` works around an upstream behaviour; each test here checks that upstream still
behaves that way, so a release that changes it fails here (and the patch can go, or must change), instead of the
patch silently doing something else. Plus: the patches are the only code that rebinds third-party attributes."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch

from disttrain import patches

SRC = Path(__file__).resolve().parents[1] / "src" / "disttrain"


def test_lightning_still_has_no_plugin_hook_for_strategy_names():
    """when_lightning_loads / register_on_first_read: Lightning fills its strategy registries from its own modules
    only. Should it load names from entry points (as it does for callbacks, ``_load_external_callbacks``), disttrain
    would declare an entry point instead of watching for Lightning's import."""
    import lightning.fabric.strategies as fabric_strategies
    import lightning.pytorch.strategies as trainer_strategies
    from lightning.fabric.strategies import registry

    for module in (fabric_strategies, trainer_strategies, registry):
        assert "entry_points" not in inspect.getsource(module), module.__name__


def test_lightnings_registry_reads_are_the_ones_that_register():
    """register_on_first_read answers every public method of Lightning's registry class: a read method added
    upstream would read the registry before disttrain's names are in it."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    for registry in (STRATEGY_REGISTRY, StrategyRegistry):
        own = next(c for c in type(registry).__mro__ if not getattr(c, "_disttrain_pending", False))
        methods = {name for name, value in vars(own).items() if callable(value) and not name.startswith("_")}
        dict_reads = {"get", "items", "keys", "values"}
        assert methods | dict_reads <= set(patches.REGISTRY_READS), methods - set(patches.REGISTRY_READS)


def test_lightnings_load_from_checkpoint_still_opens_a_folder_as_a_file(tmp_path):
    """read_checkpoint_folders: ``load_from_checkpoint`` reads through ``saving.pl_load``, Fabric's ``_load``, which
    cannot open a folder."""
    from lightning.fabric.utilities.cloud_io import _load
    from lightning.pytorch.core import saving

    assert "pl_load(" in inspect.getsource(saving._load_from_checkpoint)
    with pytest.raises((IsADirectoryError, PermissionError)):
        _load(tmp_path)


def connectors():
    from lightning.fabric.connector import _Connector
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    return _Connector, _AcceleratorConnector


@pytest.mark.parametrize("connector", connectors(), ids=["fabric", "trainer"])
def test_lightnings_connectors_still_answer_an_unknown_name_without_a_suggestion(connector):
    """suggest_strategy_names: both connectors refuse a name their registry lacks in
    ``_check_config_and_set_final_flags``, with the message the patch recognises, naming a few of Lightning's own
    strategies and suggesting none. Should Lightning suggest the closest name itself, the patch can go."""
    check = connector._check_config_and_set_final_flags
    check = getattr(check, "__wrapped__", check)  # Lightning's own, whether or not the patch is installed
    stub = connector.__new__(connector)
    stub._registered_strategies = ["ddp", "fsdp", "disttrain_fsdp"]
    with pytest.raises(ValueError) as info:
        check(stub, strategy="disttrain_fsdpp", accelerator="cpu", precision="32-true", plugins=None,
              **({"sync_batchnorm": False} if connector is connectors()[1] else {}))
    message = str(info.value)
    assert message.startswith(patches.INVALID_STRATEGY) and stub._strategy_flag == "disttrain_fsdpp"
    assert "disttrain_fsdp" not in message.replace("'disttrain_fsdpp'", "") and "mean" not in message


@pytest.mark.parametrize("connector", connectors(), ids=["fabric", "trainer"])
def test_the_name_patch_replaces_only_that_error(connector):
    """Installed by ``import disttrain``: a close name gets the suggestion, a far one and any other error of the
    method stay Lightning's."""
    import disttrain  # noqa: F401  (installs the patch when Lightning loads)

    check = connector._check_config_and_set_final_flags
    assert getattr(check, "_suggests_names", False)
    extra = {"sync_batchnorm": False} if connector is connectors()[1] else {}
    stub = connector.__new__(connector)
    stub._registered_strategies = ["ddp", "fsdp", "disttrain_fsdp"]
    stub._accelerator_types = stub._registered_accelerators = ["cpu"]
    with pytest.raises(ValueError, match=r"; did you mean 'disttrain_fsdp' or 'fsdp'\?"):
        check(stub, strategy="fsdpp", accelerator="cpu", precision="32-true", plugins=None, **extra)
    with pytest.raises(ValueError) as far:
        check(stub, strategy="xyzzy", accelerator="cpu", precision="32-true", plugins=None, **extra)
    assert "mean" not in str(far.value)
    with pytest.raises(ValueError, match="invalid accelerator name"):
        check(stub, strategy="ddp", accelerator="tpu9", precision="32-true", plugins=None, **extra)


def test_fabric_still_refuses_setup_optimizers_for_deepspeed():
    """allow_setup_optimizers_after: Fabric's own check refuses every DeepSpeed strategy."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DeepSpeedStrategy

    validate = Fabric._validate_setup_optimizers
    validate = getattr(validate, "__wrapped__", validate)  # Fabric's own, whether or not the patch is installed

    class Stub:
        _strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)

        def _validate_launched(self) -> None:
            pass

    with pytest.raises(RuntimeError, match="DeepSpeed"):
        validate(Stub(), [torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)])


def test_the_setup_optimizers_patch_leaves_other_strategies_to_fabric():
    from lightning.fabric import Fabric

    class Mine:
        pass

    patches.allow_setup_optimizers_after(Mine)
    try:
        class Stub:
            _strategy = object()

            def _validate_launched(self) -> None:
                pass

        with pytest.raises(ValueError, match="at least one optimizer"):
            Fabric._validate_setup_optimizers(Stub(), [])
    finally:
        Fabric._validate_setup_optimizers = getattr(Fabric._validate_setup_optimizers, "__wrapped__")


def test_deepspeed_still_builds_its_shared_memory_op_when_its_backend_starts():
    """skip_deepspeed_shm_op: DeepSpeed's torch backend builds the ``ShareMemCommBuilder`` op in its constructor
    unless DeepSpeed's table of ops marks it unusable; on the CPU accelerator that op exists."""
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    ds_torch = importlib.import_module("deepspeed.comm.torch")

    assert "build_shm_op()" in inspect.getsource(ds_torch.TorchBackend.__init__)
    assert "__compatible_ops__" in inspect.getsource(ds_torch.build_shm_op)
    assert CPU_Accelerator().create_op_builder(patches.SHM_OP) is not None


def test_deepspeeds_cpu_accelerator_still_refuses_fp16_without_native_kernels():
    """allow_fp16_on_deepspeed_cpu: a CPU without AVX512-FP16 or AMX is said to have no fp16."""
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512_fp16" in flags or "amx_fp16" in flags:
        pytest.skip("this CPU has native fp16 kernels: DeepSpeed accepts fp16 here without the patch")
    assert not CPU_Accelerator().is_fp16_supported()


def missing_nvml(monkeypatch) -> list[int]:
    """A machine without NVIDIA's management library or driver, under Lightning's NVML-based check: each attempt to
    load the library fails (and is counted in the list returned), the CUDA runtime counts no device."""
    loads: list[int] = []

    def failed_load() -> int:
        loads.append(1)
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # an NVML count is asked for the visible devices only
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", failed_load)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 0)
    return loads


def test_torch_still_looks_for_nvml_at_every_cuda_check_before_cuda_starts(monkeypatch):
    """remember_missing_nvml: under PYTORCH_NVML_BASED_CUDA_CHECK=1 (Lightning sets it), torch.cuda.is_available()
    loads the management library at each call until CUDA is initialised, a failed load included."""
    if torch.cuda.is_initialized() or not torch.backends.cuda.is_built():
        pytest.skip("CUDA is initialised here, or torch has no CUDA: device counts do not go through NVML")
    loads = missing_nvml(monkeypatch)
    assert [torch.cuda.is_available() for _ in range(3)] == [False] * 3
    assert len(loads) == 3


def test_a_missing_nvml_is_looked_for_once_and_answered_as_before(monkeypatch):
    """After the patch the failed load happens once; torch's answers are the same (NVML unavailable: the device
    count of the CUDA runtime), and a library that loads is asked every time, as before."""
    if not torch.backends.cuda.is_built():
        pytest.skip("torch has no CUDA here")
    loads = missing_nvml(monkeypatch)
    monkeypatch.setattr(torch.cuda, "_initialized", False)
    patches.remember_missing_nvml()
    patches.remember_missing_nvml()  # installed once
    for _ in range(3):
        assert torch.cuda._device_count_nvml() == -1 and not torch.cuda.is_available()
    assert len(loads) == 1

    counts = []
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: counts.append(1) or 1)
    patches.remember_missing_nvml()
    assert [torch.cuda._device_count_nvml() for _ in range(3)] == [1] * 3 and len(counts) == 3


def test_importing_lightning_installs_the_nvml_patch():
    import lightning  # noqa: F401

    import disttrain  # noqa: F401

    assert getattr(torch.cuda._raw_device_count_nvml, "_disttrain_missing", None) is not None


def test_only_the_patches_module_rebinds_third_party_attributes():
    """An assignment to an attribute of an imported library (``Module.name = ...``) or of a class's ``__class__``
    happens in disttrain/patches.py only; elsewhere disttrain changes its own objects."""
    libraries = {"lightning", "deepspeed", "transformers", "torchrec", "timm", "torch", "saving", "Fabric", "Init",
                 "GatheredParameters", "PreTrainedModel", "accelerator"}
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "patches.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == "__class__" and \
                        isinstance(target.value, ast.Name) and target.value.id not in ("self",):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}")
                base = target.value if isinstance(target, ast.Attribute) else None
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in libraries and isinstance(target, ast.Attribute) and \
                        not _restores_in_finally(path, node):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} {ast.unparse(target)}")
    assert not found, f"third-party attributes rebound outside disttrain/patches.py: {found}"


def _restores_in_finally(path: Path, node: ast.Assign) -> bool:
    """A rebinding undone in a ``finally`` of the same function (a context manager's temporary change) is not a
    persistent patch."""
    tree = ast.parse(path.read_text())
    target = ast.unparse(node.targets[0])
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                function.lineno <= node.lineno <= (function.end_lineno or 0):
            for sub in ast.walk(function):
                if isinstance(sub, ast.Try) and sub.finalbody:
                    restored = [ast.unparse(t) for s in sub.finalbody for s2 in ast.walk(s)
                                if isinstance(s2, ast.Assign) for t in s2.targets]
                    if target in restored:
                        return True
    return False


def test_importing_the_patches_module_patches_nothing():
    """Each patch is installed where it is needed: importing the module imports no library and changes nothing."""
    module = importlib.reload(patches)
    tree = ast.parse(inspect.getsource(module))
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {alias.name.split(".")[0] for n in top_level for alias in n.names} | \
        {(n.module or "").split(".")[0] for n in top_level if isinstance(n, ast.ImportFrom)}
    assert not names & {"lightning", "deepspeed", "torch", "transformers"}, names


ZERO_INIT_SCRIPT = """
import os, json, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed, torch
from disttrain.patches import skip_deepspeed_shm_op
skip_deepspeed_shm_op()  # no C++ build of DeepSpeed's inference-only op: not what this script is about
deepspeed.init_distributed("gloo", verbose=False)
from contextlib import nullcontext
from disttrain.parallel.engines.deepspeed import keep_decorated_inits

def decorated(cls):
    original = cls.__init__
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.marked = True
    cls.__init__ = init
    return cls

kept = sys.argv[2] == "kept"
with (keep_decorated_inits() if kept else nullcontext()), deepspeed.zero.Init(
        config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 3}}):
    @decorated
    class Layer(torch.nn.Module):  # first defined while zero.Init is open, as a lazily imported model module is
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
    inside = Layer()
after = Layer()
print(json.dumps({"inside": hasattr(inside, "marked"), "partitioned": inside.proj.weight.numel() == 0,
                  "after": hasattr(after, "marked"), "whole": after.proj.weight.numel() == 16}))
"""


@pytest.mark.parametrize("kept", ["upstream", "kept"])
def test_zero_init_drops_class_decorators_of_classes_defined_inside_unless_kept(kept, tmp_path):
    """keep_decorated_inits (parallel/engines/deepspeed.py): DeepSpeed's zero.Init puts back, on exit, the __init__ a
    class had when it was created inside the context, before its decorators ran (upstream: the decorator is lost
    for every later instance; transformers' kernel decorator on Llama's attention is one). With the helper the
    decorated __init__ stays, without zero.Init's wrapper."""
    pytest.importorskip("deepspeed")
    import json

    from conftest import free_port, run_python

    script = tmp_path / "zero_init.py"
    script.write_text(ZERO_INIT_SCRIPT)
    proc = run_python(str(script), str(free_port()), kept, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["inside"] and seen["partitioned"] and seen["whole"]
    assert seen["after"] is (kept == "kept")


def test_weights_left_uninitialised_is_what_transformers_no_init_weights_does():
    """no_broadcast_of_uninitialised_weights (parallel/engines/deepspeed.py) recognises transformers' no_init_weights by
    the no-op it puts in place of torch's init functions; transformers' own init guard (which does initialise) and
    plain torch are not taken for it. DeepSpeed's zero.Init still broadcasts each new parameter from rank 0 before
    partitioning it (the step skipped for weights a load fills): a release that stops doing so lets the patch go."""
    from deepspeed.runtime.zero.partition_parameters import Init
    from transformers.initialization import guard_torch_init_functions, no_init_weights

    from disttrain.parallel.engines.deepspeed import weights_left_uninitialised

    assert not weights_left_uninitialised()
    with no_init_weights():
        assert weights_left_uninitialised()
    with guard_torch_init_functions():
        assert not weights_left_uninitialised()
    assert not weights_left_uninitialised()
    source = inspect.getsource(Init._zero_init_param)
    assert "self._convert_to_deepspeed_param(param)" in source and "dist.broadcast(" in source
    assert source.rstrip().endswith("param.partition()")
