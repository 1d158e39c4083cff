# The two commands a new machine needs: `make demo` and `make test`. Both build and reuse .venv.
PYTHON ?= python3
TORCH ?= 2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.meshkit-installed-$(TORCH)

.PHONY: venv demo demo-synthetic demo-5d test test-all lint bench clean

venv: $(STAMP)

# torch is pinned first and alone: an open range would pull the newest CUDA build from the registry.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,hf,float8]"
	rm -f $(VENV)/.meshkit-installed-*
	touch $(STAMP)

# Real text that every machine has: part of the Python standard library's own source, tokenized by a
# byte-level BPE trained on it (a no-op when runs/data/stdlib is up to date), then 8 CPU processes train on it.
STDLIB = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])' 2>/dev/null)
DEMO_CORPUS = $(addprefix $(STDLIB)/,json email http logging)

demo: venv
	$(PY) -m meshkit.data prepare $(DEMO_CORPUS) --output runs/data/stdlib --vocab-size 512 --val-fraction 0.05 --workers 2
	$(VENV)/bin/torchrun --nproc-per-node 8 recipes/train_llama.py --config recipes/configs/stdlib_cpu.toml

# The same loop on synthetic Markov tokens (no corpus needed).
demo-synthetic: venv
	$(VENV)/bin/torchrun --nproc-per-node 8 recipes/train_llama.py --config recipes/configs/debug_cpu.toml

# All five axes at once (pp x dp_shard x cp x tp, ep folded over dp_shard x cp) on 16 processes.
demo-5d: venv
	$(VENV)/bin/torchrun --nproc-per-node 16 recipes/train_llama.py --config recipes/configs/demo_5d_cpu.toml

test: venv
	$(PY) -m pytest -q

# Every test, slow ones included, with many more hypothesis examples (about an hour on 2 cores).
test-all: venv
	HYPOTHESIS_PROFILE=dev $(PY) -m pytest -q

lint: venv
	$(VENV)/bin/ruff check meshkit recipes benchmarks tests

# Every benchmark in sequence; tables in benchmarks/RESULTS.md, charts in benchmarks/results/.
bench: venv
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
