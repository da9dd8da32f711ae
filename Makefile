# The README's two commands: `make serve` (chat server on 127.0.0.1:8080 with the default model) and `make test`.
# Both create .venv, install the package with its native extension, and pull the model they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch is enough here (and lies on the local disk of our dev/CI machines); override for CUDA machines.
TORCH_SPEC ?= torch==2.13.0
MODEL ?= smollm2-135m
HOST ?= 127.0.0.1
PORT ?= 8080
ARGS ?=

.PHONY: setup serve test test-fast test-research bench-parity bench-speed bench-kernels clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py native/build_native.py $(wildcard native/*.c native/*.h)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[server,test,cluster]"
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(BIN)/fluxion-lite pull $(MODEL)
	$(BIN)/fluxion-lite serve --model $(MODEL) --host $(HOST) --port $(PORT) $(ARGS)

test: setup
	$(BIN)/fluxion-lite pull smollm2-135m
	@if [ -f tests/support/browser_setup.sh ]; then bash tests/support/browser_setup.sh; fi
	$(BIN)/python -m pytest -q -ra tests
	# once per run: the native kernels' tests again, against an AddressSanitizer build
	$(BIN)/python native/asan_check.py

# Everything except tests marked slow (real-model runs of more than a few seconds).
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" tests

# The research scripts' tests (research/README.md): not part of `make test`; CI runs both.
test-research: setup
	$(BIN)/fluxion-lite pull smollm2-135m
	$(BIN)/python -m pytest -q -ra research/tests

bench-parity: setup
	$(BIN)/python bench/parity.py

bench-speed: setup
	$(BIN)/python bench/speed.py

bench-kernels: setup
	$(BIN)/python bench/kernels.py

clean:
	rm -rf $(VENV) build *.egg-info fluxion_lite/_native*.so
