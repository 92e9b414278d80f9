"""Check 9: the planner's step time against measured steps, on this device after calibrating it (what
``disttrain calibrate`` then ``disttrain plan --trial`` do): the dialogue LLM's 1B config at its recipe's micro-batch
and sequence, bf16-mixed, world size 1. The calibration measures the device at the model's matmul shapes and times
the model's own step; the planner then predicts each plan's step time and the trial runner measures the best two
(fresh processes, one warm-up step, a few timed ones, the median). Each plan is a row: predicted against measured,
target within 25% (``bench/planner_ranking.py`` checks the same on CPU processes).

A CPU dry run plans the tiny config from the CPU preset (no calibration) and runs the choice alone: it proves the
path runs; its figures are not judged."""

from __future__ import annotations

from typing import Any, Iterator

from gpu_checks.common import Context, Row, guarded, model_args, recipe, relative_error

CHECK = "9 step time"
TOLERANCE = 0.25
CONFIG = "configs/nlp/dialogue_1b.yaml"
PLANS = 2  # the planner's choice and the next best plan that fits
STEPS = 3  # timed steps per plan (their median counts)


def run(ctx: Context) -> Iterator[Row]:
    args = model_args(CONFIG, dry=ctx.dry)
    if ctx.dry:
        micro, seq, precision = 2, 32, "32-true"
    else:
        config = recipe(CONFIG)
        micro, seq, precision = int(config["train"]["micro_batch_size"]), int(config["data"]["seq_len"]), "bf16-mixed"
    item = f"{'tiny [dry]' if ctx.dry else 'dialogue_1b'}, {micro} x {seq}, {precision}, world size 1"

    def measure() -> list[Row]:
        plan = planned(ctx, args, micro, seq, precision)
        return [compare(c, plan, item) for c in plan.candidates if c.measured is not None]

    yield from guarded(CHECK, f"calibrate, plan and trial: {item}", f"within {TOLERANCE:.0%}", measure)


def planned(ctx: Context, args: dict[str, Any], micro: int, seq: int, precision: str) -> Any:
    """This device calibrated at the model's shapes (its own step timed), the plan for one device and its best
    :data:`PLANS` plans run by the trial runner."""
    from disttrain.planner import calibrate as cal, choose, model_spec
    from disttrain.planner.hardware import detect
    from disttrain.planner.trial import trial

    hw = detect(ctx.device, 1, calibrated=False)
    if not ctx.dry:  # a dry run plans from the CPU preset: calibration has its own test (tests/test_calibrate.py)
        spec = model_spec(args)
        path = ctx.work / "steptime" / "calibration.json"
        calibration = cal.calibrate(1, ctx.accelerator, shapes=cal.model_shapes(spec, micro, seq), path=path,
                                    models=[{"model": args, "micro_batch": micro, "seq_len": seq}])
        hw = cal.hardware_from(calibration, hw)
    plan = choose(args, 1, hw, micro_batch=micro, seq_len=seq, precision=precision)
    trial(plan, args, top=1 if ctx.dry else PLANS, steps=1 if ctx.dry else STEPS, accelerator=ctx.accelerator)
    if not any(c.measured is not None for c in plan.candidates):
        raise RuntimeError("no plan ran: " + "; ".join(r for r in plan.reasons if r.startswith("trial")))
    return plan


def compare(c: Any, plan: Any, item: str) -> Row:
    from disttrain.planner.steptime import breakdown

    err = relative_error(c.step_time, c.measured)
    ok = abs(err) <= TOLERANCE
    parts = breakdown(plan.spec, c.estimate, plan.hardware)
    return Row(CHECK, f"{c.label}: {item}", f"predicted {c.step_time:.3f} s vs measured {c.measured:.3f} s: {err:+.1%}",
               f"within {TOLERANCE:.0%}", ok, "" if ok else f"off by {err:+.1%}", kind="device", value=err,
               details={"predicted_s": c.step_time, "measured_s": c.measured, "chosen": c is plan.choice,
                        "parts_s": {k: getattr(parts, k) for k in ("compute", "optimizer", "dp_exposed", "critical",
                                                                   "overhead")}})
