"""disttrain_zero3 under Fabric as litgpt drives it (``setup_module`` then ``setup_optimizers``, ``clip_gradients``
every step) on 2 CPU processes, against one process on the global batch with torch's clip_grad_norm_."""

from __future__ import annotations

import pytest
import torch
from conftest import relative_diff, run_dist

from common import clipped_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STEPS, MAX_NORM, LR, WORLD = 4, 0.5, 0.2, 2  # as in tests/dist/zero3_fabric_loop.py


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    return run_dist("zero3_fabric_loop.py", tmp_path_factory.mktemp("zero3_fabric"))[0]


def one_process(max_norm: float) -> tuple[list[float], list[float]]:
    """(losses, gradient norms before clipping) of the unsharded model on the global batch."""
    return clipped_reference(STEPS, WORLD, max_norm, lambda params: torch.optim.SGD(params, lr=LR))


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], list[float]]:
    return one_process(MAX_NORM)


@pytest.mark.parametrize("run", ["separate", "joint", "offload_separate"])
def test_losses_match_one_process(loop, reference, run):
    assert relative_diff(loop[run]["losses"], reference[0]) <= 1e-4, (loop[run]["losses"], reference[0])


@pytest.mark.parametrize("run", ["separate", "joint", "offload_separate"])
def test_clip_gradients_returns_the_unsharded_models_norm(loop, reference, run):
    assert relative_diff(loop[run]["norms"], reference[1]) <= 1e-5
    assert min(reference[1]) > MAX_NORM  # every step was clipped


def test_clipping_changes_the_run(reference):
    """Without clipping the losses part from the reference by far more than the tolerance above."""
    unclipped, _ = one_process(float("inf"))
    assert relative_diff(unclipped, reference[0]) > 1e-3


def test_unsupported_clipping_is_refused_with_the_fix(loop):
    refused = loop["separate"]["refused"]
    assert refused["clip_val"].startswith("NotImplementedError: disttrain_zero3 clips with DeepSpeed, by norm only")
    assert "max_norm=1.0" in refused["clip_val"]
    assert refused["norm_type"].startswith("ValueError: norm_type=inf") and "norm_type=2" in refused["norm_type"]


def test_setup_optimizers_keeps_fabrics_checks_and_needs_the_model_first(loop):
    refused = loop["separate"]["refused"]
    assert refused["setup_optimizers_none"] == "ValueError: `setup_optimizers` requires at least one optimizer as input."
    assert refused["setup_optimizers_twice"].startswith("ValueError: An optimizer should be passed only once")
    assert loop["optimizer_before_model"].startswith("RuntimeError: disttrain_zero3: fabric.setup_optimizers needs the"
                                                     " model first; call model = fabric.setup_module(model)")
