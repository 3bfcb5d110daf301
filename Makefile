# cpserve — two commands on a fresh machine: `make up` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where torch comes from: empty = pip's own configuration (here, the CPU wheel on disk; on a
# plain Linux machine PyPI's torch, a CUDA build of several GB). For the CPU build anywhere:
#   make setup TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=

.PHONY: setup up test test-local bench clean sysdeps

# Debian libraries the Mooncake transfer engine loads, and a C compiler for the decode-attention
# kernel (engine/kernels) (needs root; skipped when already present).
sysdeps:
	@if ! ldconfig -p | grep -q libibverbs.so.1 || ! ldconfig -p | grep -q libnl-route-3.so.200 || ! command -v ip >/dev/null || ! command -v cc >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 libnl-3-200 libnl-route-3-200 iproute2 util-linux gcc libc6-dev >/dev/null; \
	  else echo "warning: libibverbs1/libnl or a C compiler missing and not root: install them for the Mooncake transport and the fused decode kernel"; fi; \
	fi

$(STAMP): pyproject.toml
	$(MAKE) sysdeps
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

setup: $(STAMP)

# The whole cluster on this machine: router (OpenAI API on :8000) + prefill CP=2 + decode DCP=2.
up: setup
	$(VENV)/bin/cpserve up

# Tests run inside a private network namespace with only loopback (no traffic can leave 127.0.0.1).
test: setup
	@bash scripts/run-tests.sh $(PYTEST_ARGS)

test-local: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
