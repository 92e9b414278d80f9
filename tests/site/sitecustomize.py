"""Imported at start-up by every Python process the suite starts (conftest.py puts this folder on PYTHONPATH): the
cyclic GC's youngest generation is collected every 20,000 allocations instead of 700.

A fresh interpreter of a launch (torchrun's ranks, ``disttrain run``, ``lightning run model``, Lightning's second
rank) spends ~5 s importing torch, Lightning, torchmetrics and transformers; every object those imports create lives
on, so each collection examines objects it cannot free, ~0.65 s of that CPU at the default threshold (5.9 -> 5.2 s
for ``import lightning, disttrain, transformers``' Llama). Collections still run, 28 times less often: what the
programs leave in reference cycles is freed as before, a little later. The zygotes and pytest workers also switch
the GC off while they import and freeze what they imported (tests/zygote.py); a user's processes keep Python's
default.
"""

import gc

gc.set_threshold(20_000, 10, 10)
