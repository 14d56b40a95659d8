# The two commands of README.md: `make demo` and `make test`. Each installs what it needs first.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# xds-protos ships its own, older copy of opentelemetry-proto's files (same paths); whichever pip
# installs last wins, and the OTLP exporter needs opentelemetry-proto's. Reinstalled last, so it wins.
OTEL_PROTOS = $(PY) -m pip install -q --no-deps --force-reinstall \
	"opentelemetry-proto==$$($(PY) -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"

.PHONY: install demo test lint example-config config-docs chart-envoy proto fingerprints fingerprints-check os-deps engines peers bench-overhead bench-store bench-faults bench-soak fuzz clean

$(STAMP): pyproject.toml lab/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]' -e ./lab
	$(OTEL_PROTOS)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/extproc demo

# OS packages the tests need (real redis-server and Prometheus); installed when missing and root.
os-deps:
	@bash scripts/install-os-deps.sh

# Real vLLM (its CPU build, 0.32) in a venv of its own under ~/.cache/extproc, and the lab's model
# directories built locally (never downloaded); about 2 minutes the first time, a no-op after.
engines: $(STAMP)
	$(PY) -m extproc_lab.engines.install --model tiny --model small

# The peer routers every benchmark compares against (extproc_lab.bench.peer_routers.PEER_ROUTERS),
# each pip-installed into a venv of its own under ~/.cache/extproc/peer-routers; a no-op after.
peers: $(STAMP)
	$(PY) -m extproc_lab.bench.peer_routers

# examples/router.yaml is generated from the config models (extproc/config); tests/unit/config/test_config.py keeps it equal.
example-config: $(STAMP)
	$(PY) -c "from extproc.config.example import example_yaml; print(example_yaml(), end='')" > examples/router.yaml

# docs/configuration.md's reference is made from the config models too (tests/project/test_release.py keeps it current).
config-docs: $(STAMP)
	$(PY) -c "from extproc.config.reference import write; write('docs/configuration.md')"

# The Helm chart's sidecar-layout Envoy bootstrap, rendered by extproc envoy-config (tests/project/test_helm.py keeps it current).
chart-envoy: $(STAMP)
	$(PY) scripts/chart_envoy.py

# The admin API's Python code, generated from proto/ and committed (tests/project/test_proto.py compares).
proto: $(STAMP)
	$(PY) scripts/gen_proto.py

# The simulator's fingerprints (benchmarks/sim_fingerprint.py, about 20 s): `fingerprints` rewrites
# benchmarks/sim_fingerprint.json (a change there is a change of behaviour: say why in the commit),
# `fingerprints-check` compares every run with it; tests/project/test_fingerprints.py compares a subset.
fingerprints: $(STAMP)
	nice -n 10 $(PY) benchmarks/sim_fingerprint.py --write benchmarks/sim_fingerprint.json

fingerprints-check: $(STAMP)
	nice -n 10 $(PY) benchmarks/sim_fingerprint.py --check benchmarks/sim_fingerprint.json

lint: $(STAMP)
	$(VENV)/bin/ruff check extproc lab tests benchmarks fuzz envoy
	$(VENV)/bin/ruff format --check extproc lab tests benchmarks fuzz envoy
	$(VENV)/bin/mypy

# Two xdist workers, each module on one of them and every test on real vLLM engines on the same
# one (tests/conftest.py; TEST_WORKERS=0 runs one process); then the tests that time real engines
# (marked alone), with the host to themselves (exit 5: PYTEST_ARGS selected none of them).
TEST_WORKERS ?= 2
test: $(STAMP) os-deps engines peers lint
	$(VENV)/bin/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope --durations=30 -m "not alone" $(PYTEST_ARGS)
	$(VENV)/bin/pytest -q -p no:cacheprovider --durations=10 -m alone $(PYTEST_ARGS) || [ $$? -eq 5 ]

# Envoy alone, Envoy + our processor, sglang-router and vllm-router side by side (about 3 minutes;
# the peer routers are pip-installed into venvs under ~/.cache/extproc on first use).
bench-overhead: $(STAMP) os-deps
	$(VENV)/bin/extproc bench overhead --json benchmarks/overhead.json

.PHONY: bench-realstack
bench-realstack: $(STAMP) os-deps
	nice -n 10 $(VENV)/bin/extproc bench realstack --conversations 48 --json benchmarks/realstack/48.json
	nice -n 10 $(VENV)/bin/extproc bench realstack --conversations 240 --kv-blocks 384 --json benchmarks/realstack/240-kv384.json

# GIE's inference-perf (pip-installed into ~/.cache/extproc/inference-perf on first use, from a
# Python 3.12+: $$EXTPROC_INFERENCE_PERF_PYTHON) through ours and Envoy's round robin, three workloads,
# each run on fresh fake replicas; ours also with prefill_cost.session_tokens 512 and 2048 (opt-in).
# About 9 minutes (benchmarks/inference_perf.md).
.PHONY: bench-inference-perf
bench-inference-perf: $(STAMP) os-deps
	nice -n 10 $(VENV)/bin/extproc bench inference-perf --session-tokens 512,2048 --json benchmarks/inference_perf/run.json

# The same on real vLLM engines (docs/real-vllm.md; benchmarks/realstack-vllm.md).
.PHONY: bench-realstack-vllm
bench-realstack-vllm: $(STAMP) os-deps engines
	nice -n 10 $(VENV)/bin/extproc bench realstack --engine vllm --json benchmarks/realstack/vllm.json

# Latency objectives over a load ramp through real Envoy, judged by the client (about 5 minutes;
# benchmarks/objectives_ramp.md).
.PHONY: bench-objectives-ramp
bench-objectives-ramp: $(STAMP) os-deps
	nice -n 10 $(VENV)/bin/extproc bench objectives-ramp --json benchmarks/objectives_ramp/run.json

bench-store: $(STAMP) os-deps
	$(PY) benchmarks/store_latency.py

# The fault matrix at full size (about 2 minutes) and the ten-minute soak; the suite runs both small.
bench-faults: $(STAMP) os-deps
	$(PY) benchmarks/fault_matrix.py

bench-soak: $(STAMP)
	$(PY) benchmarks/soak.py

# Longer coverage-guided fuzzing runs (bounded); the suite runs short ones.
fuzz: $(STAMP)
	$(PY) fuzz/fuzz_request.py -runs=200000 -max_len=65536 -seed=1
	$(PY) fuzz/fuzz_stream.py -runs=50000 -max_len=16384 -seed=1
	$(PY) fuzz/fuzz_kvevents.py -runs=200000 -max_len=16384 -seed=1

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
