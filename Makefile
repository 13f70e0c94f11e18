# The two commands of the README. Both set up what they need first (idempotent).
PY := .venv/bin/python
NP ?= 2
SIZES ?= 4K,64K,1M,8M,64M

.PHONY: setup setup-core bench bench-data test
setup:
	@scripts/setup_env.sh

# Without Horovod: what the allreduce and data benchmarks need.
setup-core:
	@scripts/setup_env.sh --without-horovod

# The main job: multicolor vs ring vs MPI_Allreduce on local ranks; table, JSON and plot.
bench: setup-core
	$(PY) -m mcallreduce.launch -np $(NP) -- $(PY) -m mcallreduce.bench --sizes $(SIZES) \
	    --json bench-results/bench.json --plot bench-results/bench.png

# The in-memory ImageNet store vs ImageFolder from disk (cold and warm page cache).
bench-data: setup-core
	$(PY) -m mcallreduce.data bench --out bench-results/data

# The whole test suite.
test: setup
	$(PY) -m pytest -q tests
