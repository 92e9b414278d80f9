"""Started by torchrun in every process of ``disttrain run`` / ``lightning run model``: register the disttrain
strategy names in this process, then run the user's script as ``__main__`` with its own arguments."""

import runpy
import sys
from pathlib import Path

import disttrain  # noqa: F401

script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(script).resolve().parent))
runpy.run_path(script, run_name="__main__")
