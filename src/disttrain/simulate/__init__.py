"""Simulate a strategy at its real world size on one CPU machine: the real sharding code on a fake process group.

    from disttrain.simulate import simulate
    print(simulate("configs/nlp/dialogue_10b.yaml", "disttrain_fsdp", world_size=32).table())
"""

from disttrain.simulate.core import SIMULATED, Role, Simulation, simulated_name, versus
from disttrain.simulate.strategies import simulate

__all__ = ["SIMULATED", "Role", "Simulation", "simulate", "simulated_name", "versus"]
