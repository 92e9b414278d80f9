"""Does the planner pick the fastest plan? Every plan that fits, measured on 2 CPU processes (gloo), next to the
step time the calibrated step-time model predicted for it.

    python bench/planner_ranking.py            # tiny dialogue Llama, tiny ViT, GPT-2 and Qwen2-MoE (tiny configs)
    python bench/planner_ranking.py --devices 2 4   # also on 4 processes (calibrated for 4 first)
    python bench/planner_ranking.py --smoke    # the tiny ViT, DDP and a pipeline, one step, preset figures

First this machine is calibrated (``disttrain calibrate``: matmul and blocks at the models' shapes, memory, the four
collectives over 2 processes, the framework overheads, and each model's own forward and backward; the cached
calibration is used when it has timed every model; --smoke uses the CPU preset's figures). For each model the
planner's plan lists the set-ups that fit; each is run by the trial runner of ``disttrain plan --trial`` (fresh
processes through ``disttrain run``'s launcher, one warm-up step and --steps timed ones, median), --rounds times in
alternating order (the median of the rounds counts). Printed per model: each plan's predicted and measured step
time, the spread of its rounds, the error (predicted - measured) / measured (target: within 25%), the rank
correlation (Spearman) of predicted and measured, and whether the plan the planner chose measured within 5% of the
fastest one measured.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tables import write_table  # noqa: E402

MODELS = {  # model: mapping, micro batch, sequence (tokens; a ViT's are its patches)
    "dialogue tiny": ({"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                       "tie_word_embeddings": False}, 4, 128),
    "vit tiny": ({"img_size": 32, "patch_size": 8, "in_chans": 3, "num_classes": 10, "embed_dim": 64, "depth": 4,
                  "num_heads": 4, "mlp_ratio": 2.0, "class_token": False, "global_pool": "avg"}, 16, None),
    "gpt2 tiny": ({"model_type": "gpt2", "vocab_size": 2048, "n_embd": 128, "n_layer": 4, "n_head": 4,
                   "n_positions": 128, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                   "tie_word_embeddings": False}, 4, 128),
    "qwen2-moe tiny": ({"model_type": "qwen2_moe", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 352,
                        "moe_intermediate_size": 96, "shared_expert_intermediate_size": 192, "num_experts": 4,
                        "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": False},
                       4, 128),
}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); nan for fewer than 2 points."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    if len(xs) < 2:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def model_timings(models: list[str]) -> list[dict]:
    """The models whose own steps `disttrain calibrate --model` times, at their micro-batch and sequence."""
    return [{"model": MODELS[name][0], "micro_batch": MODELS[name][1], "seq_len": MODELS[name][2]}
            for name in models]


def model_shapes(models: list[str]) -> list[tuple[int, int, int]]:
    """The matmul shapes of the models' blocks at their micro-batch: what `disttrain calibrate --model` measures."""
    from disttrain.planner import model_spec
    from disttrain.planner.calibrate import model_shapes as shapes

    out = []
    for name in models:
        mapping, micro, seq = MODELS[name]
        spec = model_spec(mapping)
        out += shapes(spec, micro, seq or spec.tokens)
    return out


def plans_of(name: str, devices: int, hw, smoke: bool):
    """The planner's plan for ``name`` on ``devices`` processes and the set-ups of it that fit (on CPU)."""
    from disttrain.planner import choose

    mapping, micro, seq = MODELS[name]
    plan = choose(mapping, devices, hw, micro_batch=micro, seq_len=seq, precision="32-true",
                  activation_checkpointing=False)
    fitting = [c for c in plan.ranked() if not c.estimate.host]  # offload moves nothing on CPU
    if smoke:  # a replica and a pipeline: the two ways a trial calls the model
        fitting = [next(c for c in fitting if c.estimate.strategy == "disttrain_ddp"),
                   next(c for c in fitting if c.estimate.dims.pp > 1)]
    return plan, fitting


def measure_rounds(plans: dict, devices: int, steps: int, rounds: int, smoke: bool) -> dict[int, float]:
    """Every fitting plan of every model measured ``rounds`` times; ``c.measured`` is the median of its rounds
    (None when it failed). Returns each plan's spread (slowest round / fastest - 1) by ``id``. The rounds run in
    alternating order, so a drift in the machine's load during the run falls on the first and the last plans alike
    instead of on whichever ran last."""
    from statistics import median

    from disttrain.planner.trial import run_one

    order = [(name, c) for name, (_, fitting) in plans.items() for c in fitting]
    times: dict[int, list[float]] = {id(c): [] for _, c in order}
    failed: set[int] = set()
    for r in range(rounds):
        for name, c in (order if r % 2 == 0 else order[::-1]):
            if id(c) in failed:
                continue
            seconds, why = run_one(MODELS[name][0], c, devices, "cpu", steps)
            if seconds is None:
                if smoke:  # the smoke run is the check that trials run at all
                    raise SystemExit(f"{name}: {c.label} did not run: {why}")
                print(f"  {name}: {c.label} did not run: {why}")
                failed.add(id(c))
            else:
                times[id(c)].append(seconds)
    for _, c in order:
        c.measured = None if id(c) in failed else median(times[id(c)])
    return {id(c): max(times[id(c)]) / min(times[id(c)]) - 1 for _, c in order if c.measured is not None}


def report_plans(name: str, devices: int, hw, plan, fitting: list, spreads: dict[int, float], rows: list,
                 summary: list) -> None:
    """Print and collect ``name``'s predicted vs measured step times, and whether its choice was the fastest."""
    from disttrain.planner.steptime import model_factor

    measured = [c for c in fitting if c.measured is not None]
    if not measured:
        return
    _, micro, _ = MODELS[name]
    fastest = min(measured, key=lambda c: c.measured)
    chosen = plan.choice if plan.choice in measured else min(measured, key=lambda c: c.step_time)
    within = chosen.measured <= fastest.measured * 1.05
    rho = spearman([c.step_time for c in measured], [c.measured for c in measured])
    factor = model_factor(plan.spec, hw)
    print(f"\n{name} on {devices} processes (micro batch {micro}; its own step {factor:.2f}x the modelled compute;"
          f" chosen: {plan.choice.label})")
    print(f"{'plan':<46} {'predicted s':>11} {'measured s':>10} {'spread':>7} {'error':>7}")
    for c in measured:
        err = (c.step_time - c.measured) / c.measured
        mark = " <- chosen" if c is chosen else (" <- fastest" if c is fastest else "")
        print(f"{c.label:<46} {c.step_time:>11.3f} {c.measured:>10.3f} {spreads[id(c)]:>7.0%} {err:>+7.0%}{mark}")
        rows.append([name, devices, c.label, c.step_time, c.measured, 100 * spreads[id(c)], 100 * err,
                     "chosen" if c is chosen else ""])
    print(f"chosen within 5% of the fastest measured: {'yes' if within else 'no'}"
          f" ({chosen.measured / fastest.measured:.2f}x); Spearman rank correlation {rho:+.2f}")
    summary.append(f"{name}, {devices} processes: chosen {chosen.label} at {chosen.measured / fastest.measured:.2f}x"
                   f" the fastest measured ({fastest.label}); Spearman {rho:+.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--steps", type=int, default=5, help="timed steps per plan and round (their median counts)")
    p.add_argument("--rounds", type=int, default=3, help="times each plan is measured, in alternating order (median)")
    p.add_argument("--devices", type=int, nargs="+", default=[2], help="process counts to plan and measure for")
    p.add_argument("--smoke", action="store_true", help="the tiny ViT, DDP and a pipeline, one step, the preset's figures")
    p.add_argument("--out-dir", default=None, help="where the Markdown + PNG table goes (default: bench/out)")
    args = p.parse_args()

    from disttrain.planner import calibrate as cal
    from disttrain.planner import hardware, model_spec

    models = ["vit tiny"] if args.smoke else args.models
    steps, rounds = (1, 1) if args.smoke else (args.steps, args.rounds)
    rows, summary = [], []
    for devices in ([2] if args.smoke else args.devices):
        hw = hardware("cpu", gpus_per_node=devices, host_memory=0)
        if args.smoke:  # the preset's figures: calibration has its own test, and a smoke run's must not be cached
            print(f"{devices} processes, the CPU preset's figures (--smoke: not calibrated)")
        else:
            calibration = cal.cached("cpu", devices)
            if calibration is None or not all(calibration.model_profile(model_spec(MODELS[name][0]))
                                              for name in models):  # every model's own step timed
                calibration = cal.calibrate(devices, "cpu", shapes=model_shapes(models), models=model_timings(models))
            hw = cal.hardware_from(calibration, hw)
            print(f"{devices} processes, calibration: {calibration.path}; overlap {calibration.overlap:.2f},"
                  f" all-reduce latency {calibration.links['all_reduce'].latency * 1e3:.2f} ms")
        plans = {name: plans_of(name, devices, hw, args.smoke) for name in models}
        spreads = measure_rounds(plans, devices, steps, rounds, args.smoke)
        for name, (plan, fitting) in plans.items():
            report_plans(name, devices, hw, plan, fitting, spreads, rows, summary)
    errors = [abs(r[6]) for r in rows]
    if errors:
        print(f"\nplans within 25% of measured: {sum(e <= 25 for e in errors)} of {len(errors)};"
              f" median |error| {sorted(errors)[len(errors) // 2]:.0f}%")
        write_table("planner_ranking", "Planner ranking against measurement",
                    f"CPU processes (gloo), fp32, median of {rounds} rounds of {steps} timed steps per plan"
                    " (spread: slowest round / fastest - 1), calibrated step-time model",
                    ["model", "processes", "plan", "predicted s", "measured s", "spread %", "error %", ""], rows,
                    bars=("measured s",), fmt={"predicted s": ".3f", "measured s": ".3f", "spread %": ".0f",
                                               "error %": "+.0f"},
                    notes=summary, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
