# Every install step lives here: a fresh clone needs only `make demo` or `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torchrec's kernels: the CUDA wheel fails to load without the NVIDIA driver, so CPU machines get the CPU build.
FBGEMM := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo fbgemm-gpu==1.9.0 || echo fbgemm-gpu-cpu==1.9.0)

.PHONY: install demo test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e ".[deepspeed,recsys,fp8,dev]"
	$(PY) -m pip install -q --no-deps torchrec==1.9.2 $(FBGEMM)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lightning run model recipes/nlp/dialogue_llm.py --accelerator cpu --devices 2 --strategy disttrain_fsdp

test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow"

bench: $(STAMP)
	$(PY) bench/fsdp_overhead.py
	$(PY) bench/zero3_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache runs data/dialogue
