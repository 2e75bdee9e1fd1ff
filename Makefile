# spotguard developer commands. Everything installs itself: `make test` on a
# fresh machine provisions the test environment (cached in $SPOTGUARD_CACHE,
# default ~/.cache/spotguard) and runs the whole suite.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
DEV ?= .dev
NODES ?= 4
# `make dev-cluster REAL=1` (or NODES_KIND=real): real nodes (kubelet + containerd) instead of process nodes;
# PULL_REGISTRY=127.0.0.1:PORT is a plain-http registry they pull from.
NODES_KIND ?= $(if $(REAL),real,process)
PULL_REGISTRY ?=
PYTEST_ARGS ?=
# Every run shows where its time goes: the slowest tests, and the wall time in all.
DURATIONS ?= 60
STARTED := $(shell date +%s)
WALL = echo "==> make $@: $$(( $$(date +%s) - $(STARTED) )) s of wall time in all (setup, lint, pytest)"

.PHONY: setup test soak unit lint demo dev-cluster dev-cluster-down preempt bench bench-large gpu-check clean

setup:
	bash testenv/provision.sh

# pytest exits 5 when it collected no tests: a suite that ran nothing is a failure.
# Randomized trial loops run at a smaller scale here (SPOTGUARD_TRIALS=quick); the
# seed is printed at the start (SPOTGUARD_TEST_SEED replays it).
# The heavy tests run in one lane, the rest beside them in another (testenv/lanes.py);
# `make test LANES=` runs everything in one pytest session instead.
LANES ?= 1
# The images the real-node tests pull are built (or found in the cache): by the real-node lane itself,
# beside the other lanes (testenv/lanes.py), or first where one session runs everything. Where they
# cannot be built (no root, no buildah) the tests that need them say so, and fail under CI.
IMAGES_FOR_TESTS = $(PY) -m testenv.images build || [ -z "$$CI" ]
# Byte-compiled once here: the suite starts hundreds of Python processes, and an
# environment that sets PYTHONDONTWRITEBYTECODE would recompile the project in each.
test: setup lint
	$(PY) -m compileall -q spotguard testenv bench >/dev/null
	$(if $(LANES),true,$(IMAGES_FOR_TESTS))
	$(if $(LANES),$(PY) -m testenv.lanes,$(PY) -m pytest) --durations=$(DURATIONS) $(PYTEST_ARGS); rc=$$?; $(WALL); \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The long run: every randomized trial loop at full scale (80 crash trials, 20
# sidecar SIGTERM trials, 30 torchrun crash trials, 3 SIGTERMs per torchrun
# preemption test, 30 chunk GC trials, the sharded races, the 20-job fleets
# with and without hostNetwork and a mixed one, the 4-rank torchrun preemption test, the process-node
# DDP gang through drain, shutdown with an operator failover and node loss (tests marked `soak`), the
# example and gang end-to-end jobs preempted by drain, shutdown and node loss, 3 preemptions
# per exact-resume and Lightning sampler run, either rank killed mid-save, both ways a pytest
# run ends).
# Two sessions: the real nodes' trials in a control plane of their own (testenv/lanes.py says why).
soak: setup
	$(IMAGES_FOR_TESTS)
	SPOTGUARD_TRIALS=full $(PY) -m pytest -m "trials and not realnodes" --durations=$(DURATIONS) $(PYTEST_ARGS); rc=$$?; \
	  SPOTGUARD_TRIALS=full $(PY) -m pytest -m "trials and realnodes" --durations=$(DURATIONS) $(PYTEST_ARGS); rc2=$$?; $(WALL); \
	  if [ $$rc -eq 5 ] && [ $$rc2 -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; \
	  for r in $$rc $$rc2; do [ $$r -eq 0 ] || [ $$r -eq 5 ] || exit $$r; done

unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# mypy's cache lives beside the toolchain, outside the clone: a fresh clone checks in seconds what
# takes a minute cold (mypy compares each module's hash with the cache's, so a stale entry is redone).
MYPY_CACHE ?= $(or $(SPOTGUARD_CACHE),$(HOME)/.cache/spotguard)/mypy
# Size limits (a module of spotguard/ over 700 lines, the Checkpointer class over 400)
# and broad excepts with no reason on their line fail here (testenv/lint_limits.py).
lint: setup
	$(VENV)/bin/ruff check spotguard tests testenv bench
	$(VENV)/bin/ruff format --check spotguard tests testenv bench
	$(VENV)/bin/lint-imports
	$(PY) -m testenv.lint_limits spotguard
	$(VENV)/bin/mypy --cache-dir "$(MYPY_CACHE)"

demo:
	bash testenv/provision.sh --python-only
	$(VENV)/bin/spotguard demo

# The dev cluster, plus the bucket and Secret that examples/trainingjob.yaml uses.
dev-cluster: setup
	$(PY) -m testenv.cluster up --state-dir $(DEV) --nodes $(NODES) --nodes-kind $(NODES_KIND) $(if $(PULL_REGISTRY),--registry $(PULL_REGISTRY))
	DEV=$(abspath $(DEV)) bash examples/dev-setup.sh default

dev-cluster-down:
	$(PY) -m testenv.cluster down --state-dir $(DEV)

preempt:
	@test -n "$(POD)" || { echo "usage: make preempt POD=<name> MODE=drain|shutdown|kill [NAMESPACE=default]"; exit 2; }
	$(PY) -m testenv.processnode preempt --state-dir $(DEV)/nodes --pod $(POD) --namespace $(or $(NAMESPACE),default) --mode $(or $(MODE),drain)

# Side-by-side benchmarks; writes docs/benchmarks.md and docs/bench/*.png.
bench: setup
	$(PY) -m bench.run

# The users' size: the SIGTERM rounds and the fine-tune's plain and incremental rounds at 8 GiB
# beside a small size, stall, upload and resume at 2 GiB, then the goodput section on their costs
# (bench/run.py says what each variable sizes). Needs about 20 GiB of memory and 40 GiB of disk;
# writes its report to a temporary directory (printed), not over docs/.
bench-large: setup
	BENCH_STATE_MB=2048 BENCH_SIGTERM_GB=1,8 BENCH_INCREMENTAL_FROZEN_GB=0.25,8 \
	  $(PY) -m bench.run --only stall,upload,resume,sigterm,incremental,goodput --rounds 3

# On a machine with GPUs: nccl DDP and FSDP2, SIGTERM -> verified, bit-exact resume,
# pinned staging, stall vs dcp.async_save; non-zero exit on any failure (docs/gpu-check.md).
gpu-check: setup
	$(PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

# The Dockerfile's two images, built without a Docker engine (buildah; testenv/images.py) and
# cached by content in $SPOTGUARD_CACHE/images: `make images` prints their names and OCI references.
# `make push-images REGISTRY=registry.example.com/ml` pushes them as
# $(REGISTRY)/spotguard/spotguard:VERSION and $(REGISTRY)/spotguard/spotguard-torch:VERSION
# (TLS_VERIFY=false: a plain-HTTP or self-signed registry).
# `make release`: from a fresh clone of HEAD into dist/, the wheel and sdist (twine check),
# the packaged chart and both images as OCI archives (dist/images/).
.PHONY: images push-images release
images: setup
	$(PY) -m testenv.images build

push-images: setup
	@test -n "$(REGISTRY)" || { echo "usage: make push-images REGISTRY=host[:port][/path] [TLS_VERIFY=false]" >&2; exit 2; }
	$(PY) -m testenv.images push --registry $(REGISTRY) $(if $(filter false,$(TLS_VERIFY)),--no-tls-verify)

release: setup
	$(PY) -m testenv.release --out dist

clean:
	rm -rf $(VENV) $(DEV) .lanes .pytest_cache .mypy_cache .ruff_cache
