# Two commands do everything on a fresh machine: `make demo` and `make test`.
# megatron-core 0.19.2 needs Python >= 3.12 (megatron.training uses typing.override); pyenv has it.
PYTHON312 ?= $(shell PYENV_VERSION=3.12.1 pyenv which python 2>/dev/null || command -v python3.12)
VENV := .venv
PY := $(VENV)/bin/python
NPROC ?= 2
TORCH_VERSION ?= 2.13.0

.PHONY: venv demo test test-fast functional bench clean

$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[megatron,test,muon]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) examples/megatron_demo.py --nproc $(NPROC)

test: venv
	$(PY) -m pytest -q tests

functional: venv
	$(VENV)/bin/torchrun --nproc-per-node=$${NGPU:-1} -m pytest -q tests/functional

clean:
	rm -rf $(VENV) build *.egg-info
