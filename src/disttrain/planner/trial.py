"""Trials: the best few plans by the step-time model, each run for a few steps on the devices present, and the
fastest measured one chosen (``disttrain plan --trial``, ``AutoStrategy(trial=True)``).

Each plan runs in fresh processes started by ``disttrain run``'s launcher (``trial_run.py``): a model built from the
config with random weights, the plan's strategy and options, micro-batch, precision and checkpointing, random data of
the plan's shapes, one warm-up step and ``steps`` timed ones, more while they add up to less than
:data:`MIN_SECONDS` (the median counts). A plan that fails to run is reported and left out. The model must be
buildable from its config (a recipe YAML path, its ``model:`` mapping or an HF config dict): a trial never pickles a
user's module.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from disttrain.planner.choose import Candidate, Plan

# The worker runs a Fabric loop, so it lives with the Fabric adapters (the planner itself never imports Lightning).
WORKER = Path(__file__).parents[1] / "fabric" / "trial_run.py"
# A plan is timed for at least this long: three steps of a few milliseconds are mostly noise, and the first ones
# after the warm-up run slower (caches, the allocator): a tiny ViT's DDP step read 11-16 ms over 5 steps, 11-12 over 30.
MIN_SECONDS = 0.5


def trial_source(source: Any) -> Any:
    """What a trial process can build the model from: a recipe YAML path or a ``model:`` mapping (JSON-able)."""
    if isinstance(source, (str, os.PathLike)) and Path(source).suffix in (".yaml", ".yml"):
        return str(Path(source).resolve())
    if isinstance(source, dict):
        mapping = source.get("model", source) if isinstance(source.get("model"), dict) else source
        try:
            json.dumps(mapping)
        except TypeError:
            pass
        else:
            return mapping
    raise ValueError(f"trial=True needs the model as a recipe YAML path or its `model:` dict (the trial builds it in"
                     f" fresh processes), not {type(source).__name__}: pass model='configs/...yaml' or leave trial"
                     " off")


def run_one(source: Any, c: Candidate, devices: int, accelerator: str, steps: int, timeout: float = 600.0,
            min_seconds: float = MIN_SECONDS) -> tuple[Optional[float], str]:
    """(median measured step seconds, "") of candidate ``c``, or (None, why it failed): ``steps`` timed steps
    after one warm-up, more while they take less than ``min_seconds`` in all."""
    e = c.estimate
    job = {"model": source, "strategy": e.strategy, "options": e.options, "micro_batch": e.micro_batch,
           "seq_len": e.seq_len, "precision": e.precision, "model_recomputes": e.model_recomputes, "steps": steps,
           "min_seconds": min_seconds, "label": c.label}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        command = [sys.executable, "-m", "disttrain.cli", "run", str(WORKER), "--devices", str(devices),
                   "--accelerator", accelerator, "--", str(out), json.dumps(job)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"no result within {timeout:.0f} s"
        if done.returncode != 0 or not out.exists():
            lines = [l for l in (done.stderr + done.stdout).splitlines()
                     if "Error" in l and "Warning" not in l and "register_constant" not in l]
            return None, (lines[-1].strip() if lines else f"exit {done.returncode}")[:200]
        return json.loads(out.read_text())["median"], ""


def trial(plan: Plan, source: Any, top: int = 3, steps: int = 3, accelerator: Optional[str] = None,
          runner: Optional[Callable[..., tuple[Optional[float], str]]] = None) -> Plan:
    """Run the estimate's choice and the next ``top - 1`` plans that fit (by estimated throughput) on ``plan.world_size`` processes here and make
    the fastest measured (samples per second) the choice; ``plan``'s candidates get their ``measured`` step times
    and its reasons say what was measured."""
    if top < 1:
        raise ValueError(f"--trial-top {top} must be at least 1")
    if steps < 1:
        raise ValueError(f"--trial-steps {steps} must be at least 1")
    model = trial_source(source)
    accelerator = accelerator or ("cpu" if plan.hardware.name == "cpu" else "cuda")
    runner = runner or run_one
    tried = ([plan.choice] + [c for c in plan.ranked() if c is not plan.choice])[:top]
    failed = []
    for c in tried:
        c.measured, why = runner(model, c, plan.world_size, accelerator, steps)
        if c.measured is None:
            failed.append(f"{c.label}: {why}")
    ran = [c for c in tried if c.measured is not None]
    if not ran:
        plan.reasons.append("trial: no plan ran (" + "; ".join(failed) + "); the estimate's choice stands")
        return plan

    def measured_rate(c: Candidate) -> float:
        return c.estimate.micro_batch * c.estimate.world_size / c.measured

    best = max(ran, key=measured_rate)
    before = plan.choice
    plan.choice = best
    lines = ", ".join(f"{c.label} {c.measured:.3g} s (estimated {c.step_time:.3g} s)" for c in ran)
    plan.reasons.append(f"trial: {len(ran)} plans run {steps} steps each on {plan.world_size} {accelerator}"
                        f" processes: {lines}; the fastest measured is {best.label}"
                        + ("" if best is before else f" (the estimate preferred {before.label})"))
    plan.reasons += [f"trial failed: {f}" for f in failed]
    return plan


def trial_once(plan: Plan, source: Any, top: int, steps: int, accelerator: str) -> Plan:
    """:func:`trial` where every rank of a job must agree: one process runs it and the others read its result.
    Under Lightning's own launcher rank 0 plans before it starts the others, which inherit the result through the
    environment; under torchrun (``disttrain run``) local rank 0 runs it and the others wait for its file."""
    key = hashlib.sha1(json.dumps([repr(trial_source(source)), plan.world_size,
                                   [c.label for c in plan.ranked()], top, steps]).encode()).hexdigest()[:16]
    env = f"DISTTRAIN_TRIAL_{key}"
    if env in os.environ:
        return _apply(plan, json.loads(os.environ[env]))
    launched = "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ
    if launched:
        from disttrain.planner.calibrate import cache_dir

        run_id = f"{os.environ['TORCHELASTIC_RUN_ID']}-{os.environ.get('MASTER_PORT', '')}"
        path = cache_dir() / "trials" / f"{key}-{run_id}.json"
        if os.environ["LOCAL_RANK"] != "0":
            deadline = time.time() + 3600
            while not path.exists():
                if time.time() > deadline:
                    raise TimeoutError(f"disttrain_auto: local rank 0's trial result {path} never appeared")
                time.sleep(1)
            return _apply(plan, json.loads(path.read_text()))
    trial(plan, source, top, steps, accelerator)
    result = {"measured": {c.label: c.measured for c in plan.candidates if c.measured is not None},
              "choice": plan.choice.label if plan.choice else None, "reasons": plan.reasons[-3:]}
    os.environ[env] = json.dumps(result)  # the processes this one starts plan the same
    if launched:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)
    return plan


def _apply(plan: Plan, result: dict) -> Plan:
    for c in plan.candidates:
        c.measured = result["measured"].get(c.label, c.measured)
    chosen = next((c for c in plan.candidates if c.label == result["choice"] and c.fits), None)
    if chosen is not None:
        plan.choice = chosen
    plan.reasons += [r for r in result["reasons"] if r.startswith("trial")]
    return plan
