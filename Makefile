# Two commands on a fresh machine: `make main` (the main job) and `make test`. Each installs what it
# needs into .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: main test lint format bench clean

$(STAMP): pyproject.toml requirements/study-lock.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the study's exact environment (requirements/study-lock.txt) as constraints: CI tests what the study ran on
	$(PY) -m pip install -q -e ".[corpus,dev]" -c requirements/study-lock.txt
	# tinysoundfont renders the studies' corpora; it declares pyaudio (live playback only; needs PortAudio
	# headers): install it without. The default corpus needs neither (musiclm_stab/corpus/sampler.py).
	$(PY) -m pip install -q --no-deps tinysoundfont==0.3.7
	touch $(STAMP)

main: $(STAMP)
	$(VENV)/bin/musiclm-stab quickstart

test: $(STAMP)
	$(VENV)/bin/pytest -q -n 2 --dist loadfile  # two workers, each file on one (pytest-xdist)

lint: $(STAMP)
	$(VENV)/bin/ruff check musiclm_stab tests data benchmarks  # recipes/ is musiclm_stab/recipes

format: $(STAMP)
	$(VENV)/bin/ruff format musiclm_stab tests data benchmarks

TOKENS := work/default_corpus_sampler_tokens/tokenizer.json
$(TOKENS): $(STAMP)
	$(VENV)/bin/musiclm-stab quickstart --data-only

# The CPU benchmarks, short settings (results and the longer commands: benchmarks/README.md).
bench: $(STAMP) $(TOKENS)
	$(PY) benchmarks/bench_train_step.py --size base --schemes pre --repeats 2 --variants ours before peer
	$(PY) benchmarks/bench_input.py --data work/default_corpus_sampler_tokens --size tiny --steps 20 --rounds 2
	$(PY) benchmarks/bench_processes.py --data work/default_corpus_sampler_tokens --steps 20 --warmup 5 --repeats 1
	$(PY) benchmarks/bench_cqt.py --seconds 30 --repeats 5
	$(PY) benchmarks/bench_tokenize.py throughput --work work/bench_tokenize --tracks 4 --repeats 1 \
		$(if $(wildcard work/encodec_local_seed0_sampler.pt),--weights work/encodec_local_seed0_sampler.pt)

clean:
	rm -rf work runs
