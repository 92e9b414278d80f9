"""The planner: per-rank memory of a model under every disttrain strategy, and the choice of one.

    from disttrain.planner import estimate, choose
    estimate("configs/nlp/dialogue_10b.yaml", "disttrain_zero3", world_size=32, micro_batch=1, seq_len=2048)
    choose("configs/nlp/dialogue_10b.yaml", world_size=32, hardware="A100-40GB").report()
"""

from disttrain.planner.choose import Candidate, Plan, choose, step_time
from disttrain.planner.estimate import Estimate, activation_bytes, estimate, planned, table_placement
from disttrain.planner.hardware import PRESETS, Hardware, detect, hardware
from disttrain.planner.spec import ModelSpec, model_spec, parse_bytes

__all__ = [
           "PRESETS",
           "Candidate",
           "Estimate",
           "Hardware",
           "ModelSpec",
           "Plan",
           "activation_bytes",
           "choose",
           "detect",
           "estimate",
           "hardware",
           "model_spec",
           "parse_bytes",
           "planned",
           "step_time",
           "table_placement",
]
