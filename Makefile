# Every install step lives here: a fresh clone needs only `make demo` or `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torchrec's kernels: the CUDA wheel fails to load without the NVIDIA driver, so CPU machines get the CPU build.
FBGEMM := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo fbgemm-gpu==1.9.0 || echo fbgemm-gpu-cpu==1.9.0)
# uv installs what pip would, with downloads and unpacking in parallel: ~55 s instead of pip's ~85 s for torch and
# the rest (its cache, ~/.cache/uv, makes a reinstall after `make clean` quicker still). Installed modules are
# byte-compiled, as pip does. uv reads no pip configuration: the package index pip is told to use (PIP_INDEX_URL, or
# index-url in pip.conf) is handed to it; otherwise it installs from PyPI.
PIP_INDEX  = $(or $(PIP_INDEX_URL),$(shell python3 -m pip config get global.index-url 2>/dev/null))
UV_INDEX   = $(if $(PIP_INDEX),--default-index $(PIP_INDEX))
UV_INSTALL = $(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode $(UV_INDEX)

# The interpreter .venv is made from: VENV_PYTHON=... when given, else the distribution's Python 3 (/usr/bin/python3)
# when it is a version torch's wheels support (3.10-3.13) and has its venv module, else the `python3` on PATH.
# Distributions build their Python with profile-guided and link-time optimisation, the interpreter linked statically;
# a Python compiled without them (pyenv's default) runs Python code ~15% slower, and the test suite's tiny models
# spend most of their time in Python (tests/test_hf_plans.py: 102-108 s of CPU against 123-129 s).
SUPPORTED    = import sys, ensurepip, venv; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 13))
SYSTEM_PY   := $(shell /usr/bin/python3 -c '$(SUPPORTED)' 2>/dev/null && echo /usr/bin/python3)
VENV_PYTHON ?= $(or $(SYSTEM_PY),python3)

.PHONY: install demo test test-fast durations bench docs clean gpu-wheels gpu-check multi-host

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(VENV_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv==0.13.9
	$(UV_INSTALL) torch==2.14.1 torchvision==0.29.1
	$(UV_INSTALL) -c constraints.txt -e ".[deepspeed,recsys,fp8,dev]"
	$(UV_INSTALL) --no-deps torchrec==1.9.2 $(FBGEMM)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lightning run model recipes/nlp/dialogue_llm.py --accelerator cpu --devices 2 --strategy disttrain_fsdp \
	    --config configs/nlp/dialogue_demo.yaml

# Two pytest workers, whole files each (module fixtures stay shared; the files sharing conftest's session launches
# go together), longest first (tests/scheduling.py): a multi-process test spends much of its time in rendezvous,
# gloo waits and file I/O, so a second one beside it nearly halves the wall time on 2 cores.
# `make test JOBS=0` runs in one process; `make durations` re-measures the files' seconds that order them.
JOBS ?= 2
XDIST = $(if $(filter 0,$(JOBS)),-p no:xdist,-n $(JOBS) --dist loadfile --no-loadscope-reorder)

# The project's own modules byte-compiled first (the installed packages are at install): where
# PYTHONDONTWRITEBYTECODE=1 is set, as on many CI machines, every process the suite starts would otherwise compile
# the ~70 disttrain modules a rank imports from source again (~0.13 s of CPU each, hundreds of processes).
COMPILE = $(PY) -m compileall -q src tests bench recipes tools > /dev/null

test: $(STAMP)
	$(COMPILE)
	$(PY) -m pytest -q -ra --durations=25 $(XDIST)

test-fast: $(STAMP)
	$(COMPILE)
	$(PY) -m pytest -q -ra -m "not slow" $(XDIST)

durations: $(STAMP)
	$(COMPILE)
	$(PY) -m pytest -q $(XDIST) --record-durations tests/durations.json

# The demo on 2 hosts made of network namespaces on this machine (tools/hosts.py; needs root): traffic between them
# crosses their interfaces, and each host's bytes sent are printed.
multi-host: $(STAMP)
	$(PY) tools/hosts.py --hosts 2 -- $(CURDIR)/.venv/bin/disttrain run --num-nodes {hosts} --node-rank {rank} \
	    --main-address {main} --accelerator cpu --devices 1 --strategy disttrain_fsdp \
	    recipes/demo/tiny_llama.py --steps 20 --logger none --out runs/hosts-demo-{rank}

bench: $(STAMP)
	$(PY) bench/fsdp_overhead.py
	$(PY) bench/zero3_overhead.py

# The API reference, generated from the docstrings (docs/api, Sphinx): open build/api/index.html.
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs/api build/api
	@echo "API reference: build/api/index.html"

clean:
	rm -rf $(VENV) .pytest_cache runs data/dialogue build/api

# The GPU check runs with the GPU machine's own Python and torch (no .venv needed there, nor access to PyPI):
# `make gpu-wheels`, on a machine that reaches PyPI, puts what that Python may lack into the git-ignored .whl/ (kept
# small enough to copy with the repository), and `make gpu-check` on the GPU machine installs them beside its
# packages and runs bench/gpu_check.py (at most 8 minutes).
GPU_PY    ?= python3
GPU_OUT   ?= runs/gpu_check
GPU_SITE  ?= /tmp/disttrain-gpu-site
GPU_ARGS  ?=
WHL_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
                 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
# torchao: FP8; chatterbot-corpus: the dialogue demo corpus; hjson and pydantic (+ its parts): what DeepSpeed needs
# beyond that machine's packages. DeepSpeed itself is a source release: built into a wheel here.
GPU_WHEELS := torchao==0.18.0 chatterbot-corpus==1.3.3 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 \
              annotated-types==0.8.0 typing-inspection==0.4.5

gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    $(WHL_PLATFORMS) -d .whl $(GPU_WHEELS)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
	@du -sh .whl
	@test $$(du -sm .whl | cut -f1) -le 56 || { echo ".whl is over 56 MiB: the tree and the wheels must fit 64 MiB"; exit 1; }

gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then \
	    $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) \
	        .whl/*.whl; fi
	PYTHONPATH=src:$(GPU_SITE) PYTHONUNBUFFERED=1 $(GPU_PY) bench/gpu_check.py --out $(GPU_OUT) $(GPU_ARGS)
