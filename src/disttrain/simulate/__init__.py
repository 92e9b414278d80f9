"""Simulate a strategy at its real world size on one CPU machine: the real sharding code on a fake process group.

    from disttrain.simulate import simulate
    print(simulate("configs/nlp/dialogue_10b.yaml", "disttrain_fsdp", world_size=32).table())
"""

from disttrain.simulate.core import Role, Simulation, versus
from disttrain.simulate.strategies import simulate, simulated

__all__ = ["Role", "Simulation", "simulate", "simulated", "versus"]
