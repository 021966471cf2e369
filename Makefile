# Two commands do all set-up on a fresh machine:
#   make train   the main job: pretrain_gpt.py on 4 CPU ranks (2 simulated nodes x 2), zeropp policy
#   make test    the test suite (CI: .ci/run)
# Both create .venv (Python 3.12, megatron-core 0.19) and build the C++ kernels when missing.

PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12 2>/dev/null) python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test test-oldest-torch gpu-kit test-gpu-kit soak sanitize launch-loop bench bench-codecs bench-collectives bench-training sweep cuda-build clean

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.h csrc/include/zpp/*.h csrc/include/zpp/*.cuh)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.15.*" "setuptools>=69" wheel ninja
	$(PY) -m pip install -q --no-build-isolation -e ".[dev]"
	touch $@

# The main job's embedded default: a small GPT (4 layers, hidden 256) on the built-in corpus (the Python
# standard library's sources), distributed optimizer with overlap, ZeRO++ policy, ~2 minutes on 2 cores.
NPROC ?= 4
TRAIN_ARGS ?= --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
	--zpp-policy zeropp --zpp-ranks-per-node 2 \
	--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 \
	--micro-batch-size 4 --global-batch-size 32 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 8 \
	--lr-decay-style cosine --adam-beta2 0.95 --hidden-dropout 0.0 --attention-dropout 0.0 \
	--train-iters 80 --log-interval 10 --eval-iters 4

# OMP_NUM_THREADS: torchrun sets it to 1 itself when it is unset, with a 4-line banner saying so; the same value,
# without the banner (a value in the environment wins).
train: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/torchrun --nproc-per-node $(NPROC) pretrain_gpt.py $(TRAIN_ARGS) $(ARGS)

bench: bench-codecs bench-collectives

bench-codecs: $(STAMP)
	$(PY) tools/bench_codecs.py $(ARGS)

bench-collectives: $(STAMP)
	$(PY) tools/bench_collectives.py $(ARGS)

# W&B policy sweep (tools/sweep.py) on the emulated 2-node x 2-rank cluster, offline W&B runs; the
# table, plots and runs land in $(SWEEP_OUT). Needs root: netemu creates network namespaces and tc
# qdiscs. `make sweep SWEEP=configs/sweeps/policies-vs-bandwidth.yaml` runs the full grid (hours).
SWEEP ?= configs/sweeps/smoke.yaml
SWEEP_OUT ?= out/sweeps/$(basename $(notdir $(SWEEP)))

sweep: $(STAMP)
	@test "$$(id -u)" = 0 || { echo "make sweep needs root (netemu: namespaces, tc): sudo make sweep"; exit 1; }
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) tools/sweep.py $(SWEEP) --local --out-dir $(SWEEP_OUT) $(ARGS)

# The measured performance study of docs/performance.md (needs root; about an hour on 2 cores): the full
# W&B sweep (every policy x inter-node rate x ZeRO path on the emulated cluster), a calibration of that
# cluster, and the performance model checked against every measured run.
BENCH_OUT ?= out/sweeps/policies-vs-bandwidth
bench-training: $(STAMP)
	@test "$$(id -u)" = 0 || { echo "make bench-training needs root (netemu): sudo make bench-training"; exit 1; }
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) tools/sweep.py configs/sweeps/policies-vs-bandwidth.yaml --local \
		--out-dir $(BENCH_OUT) $(ARGS)
	$(PY) tools/calibrate.py --emulate --nodes 2 --ranks-per-node 2 --rate 100mbit --out $(BENCH_OUT)/emulated-2x2.yaml
	$(PY) tools/model_check.py $(BENCH_OUT)/results.csv --cluster $(BENCH_OUT)/emulated-2x2.yaml \
		--plot $(BENCH_OUT)/model-vs-measured.png --json $(BENCH_OUT)/model-vs-measured.json

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

# The oldest supported torch (CI runs this after `make test`): a separate venv with torch 2.11 and the oldest
# megatron-core, a copy of the working tree installed into it with --no-build-isolation and its dependencies
# (so pip's resolver sees the installed torch and must keep it: test_packaging asserts it does), then the
# codec, comm and one short training test against torch 2.11. The copy keeps the tree's own kernels (built
# against the pinned torch) apart from the ones built here.
OLDEST_VENV := .venv-oldest
OLDEST_TORCH ?= 2.11
OLDEST_MCORE ?= 0.16
OLDEST_SRC := $(OLDEST_VENV)/src
OLDEST_TESTS ?= tests/test_packaging.py tests/test_codecs.py \
	"tests/test_comm.py::test_collectives_match_torch_and_codec_bounds[2x2]" \
	"tests/test_comm.py::test_compressed_all_reduce[2x2]" tests/test_comm.py::test_nan_and_inf_reach_the_output \
	tests/test_comm.py::test_inside_coalescing_manager \
	tests/test_megatron.py::test_dp4_distributed_optimizer_2x2_with_and_without_overlap

test-oldest-torch:
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install -q "torch==$(OLDEST_TORCH).*" "megatron-core==$(OLDEST_MCORE).*" \
		"setuptools>=70.1" wheel ninja pytest
	rm -rf $(OLDEST_SRC) && mkdir -p $(OLDEST_SRC)
	git ls-files -z --cached --others --exclude-standard | tar --null -T - --ignore-failed-read -cf - | tar -xf - -C $(OLDEST_SRC)
	cd $(OLDEST_SRC) && ../bin/python -m pip install -q --no-build-isolation -e .
	cd $(OLDEST_SRC) && ZPP_EXPECT_TORCH=$(OLDEST_TORCH) ZPP_EXPECT_MCORE=$(OLDEST_MCORE) \
		../bin/python -m pytest -q -p no:cacheprovider $(OLDEST_TESTS) $(ARGS)

# Soak (tools/soak.py): 2000 steps of every policy preset, and zeropp on Megatron-FSDP, on a tiny GPT with 4 CPU
# ranks (2 simulated nodes x 2); fails on a NaN, a failed run, scratch pools growing after warm-up, byte counters
# that drift, or anonymous resident memory growing faster than 0.2 MB per 100 steps after warm-up
# (docs/soak/README.md). About 30-50 minutes on 2 idle cores (1000 steps took 25); results in $(SOAK_OUT).
SOAK_OUT ?= out/soak
soak: $(STAMP)
	$(PY) tools/soak.py --out $(SOAK_OUT) $(ARGS)

# Heap-corruption checks (docs/reliability/heap-corruption.md). sanitize: the C++ extension built with ASan +
# UBSan into out/sanitize (never over the in-place build), then the codec, kernel, collective and training tests
# with the sanitizer runtimes preloaded; results in out/sanitize/results.md. launch-loop: the smallest
# Megatron-FSDP launch repeated for LOOP_MINUTES under MALLOC_CHECK_=3 and MALLOC_PERTURB_.
LOOP_MINUTES ?= 60
sanitize: $(STAMP)
	$(PY) tools/sanitize.py $(ARGS)

launch-loop: $(STAMP)
	nice -n 10 $(PY) tools/launch_loop.py --minutes $(LOOP_MINUTES) --out out/launch-loop $(ARGS)

cuda-build: $(STAMP)
	$(PY) tools/cuda_build.py

# The offline kit for a GPU machine without network (tools/gpu_kit.py): the sdist of this package and the
# Python 3.12 manylinux wheels of the runtime dependencies a CUDA torch image lacks, never torch; fails
# over 60 MiB with every file's size. Needs the network here. Install instructions: .gpukit/README.md.
GPUKIT ?= .gpukit
gpu-kit: $(STAMP)
	$(PY) tools/gpu_kit.py --out $(GPUKIT) $(ARGS)

# CI: build the kit, install it offline into a scratch folder, import the package from there.
test-gpu-kit: gpu-kit
	ZPP_GPU_KIT=$(GPUKIT) $(PY) -m pytest -q -m slow tests/test_packaging.py -k gpu_kit

clean:
	rm -rf build megatron_zpp/*.so $(STAMP) $(OLDEST_VENV) $(GPUKIT)

# The GPU check (tools/gpu_check.py) on a GPU machine without network: installs the offline kit
# (make gpu-kit, copied here as .gpukit/) into the report folder with --no-deps, builds the CUDA
# extension for this GPU against the image's torch, runs every check step with its own time limit and
# writes gpu_report.md/.json to $(GPU_CHECK_OUT). No .venv: it uses the image's python3 and torch.
# `make gpu-check ARGS=--quick` (<= 5 minutes after the build), ARGS=--dry-run (no GPU needed).
GPU_PYTHON ?= python3
GPU_CHECK_OUT ?= out/gpu-check/$(shell date -u +%Y%m%dT%H%M%SZ)
.PHONY: gpu-check
gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py --out $(GPU_CHECK_OUT) --kit .gpukit $(ARGS)
