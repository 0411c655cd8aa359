# Two commands on a fresh machine: `make main` (the main job) and `make test`. Each installs what it
# needs into .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: main test lint format bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[corpus,dev]"
	# tinysoundfont declares pyaudio (live playback only; needs PortAudio headers): install without it.
	$(PY) -m pip install -q --no-deps tinysoundfont
	touch $(STAMP)

main: $(STAMP)
	$(VENV)/bin/musiclm-stab quickstart

test: $(STAMP)
	$(VENV)/bin/pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check musiclm_stab tests recipes data benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff format musiclm_stab tests recipes data benchmarks

bench: $(STAMP)
	$(PY) benchmarks/bench_cqt.py

clean:
	rm -rf work runs
