# dedloc: two set-up commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip --disable-pip-version-check
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml tests/example_plugin/pyproject.toml | sha256sum | cut -c1-12)
PYTEST_ARGS ?=
# Test processes (pytest-xdist): most tests wait on real daemons, so more than the cores pay off
# (2026-12-07, clean clone on 2 cores: 717 s with 4, 886 s with 3; the CPUs were 136 % busy).
# Not more than 4: with 6 the suite took 982 s where 4 took 888-1008 s (its CPU is the limit:
# 160 torch workers and 260 daemons start in it, about 3.4 and 1 CPU-seconds each).
TEST_PROCESSES ?= 4

.PHONY: demo test lint docs venv system-deps clean

# The virtual environment with dedloc (editable), the worker's torch (pinned: pip takes it from
# this machine's disk), the test tools and the example third-party plugin the tests load.
$(STAMP): pyproject.toml tests/example_plugin/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[worker,test]'
	$(PIP) install -q --force-reinstall --no-deps ./tests/example_plugin
	@rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

# What the tests need from the system: systemd-analyze to check the service unit; for the NAT lab
# (tests/natlab.py, network namespaces): ip and tc, nft, conntrack, iptables and coturn's turnserver;
# for the shell example client (examples/dedloc-client.sh, tests/test_example_client.py): socat, jq.
NATLAB_TOOLS := ip:iproute2 tc:iproute2 nft:nftables iptables:iptables conntrack:conntrack \
	turnserver:coturn sysctl:procps socat:socat jq:jq
# Headless chromium renders the daemon's dashboard in tests/web.
BROWSER_TOOLS := chromium:chromium
system-deps:
	@command -v systemd-analyze >/dev/null || { apt-get update -q && apt-get install -y -q systemd; }
	@missing=$$(for pair in $(NATLAB_TOOLS) $(BROWSER_TOOLS); do PATH=$$PATH:/usr/sbin:/sbin command -v $${pair%%:*} >/dev/null || \
		echo $${pair#*:}; done | sort -u); \
	if [ -n "$$missing" ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			--no-install-recommends $$missing; \
	fi

# `make demo WORKLOAD=albert` trains the tiny preset of another workload instead.
WORKLOAD ?= tiny
demo: venv
	$(PY) -m dedloc.cli.demo --workload $(WORKLOAD)

# One OpenMP/MKL thread per torch process: the suite runs several test processes, daemons and
# workers on two cores, and OpenMP threads that spin-wait on an oversubscribed CPU made a 17 s
# model test take 100 s (tests that want more threads ask torch for them).
# Bytecode caches are written (__pycache__, git-ignored) even where the environment says not to
# (PYTHONDONTWRITEBYTECODE=1; empty is off): the suite starts hundreds of daemons and workers,
# and without them each compiled dedloc from source and each test process rewrote every test
# module's asserts (tests/hostile: 68.6 s of CPU instead of 42.0 s).
# The example plugin is reinstalled with the venv's setuptools (torch's dependency): an isolated
# build fetched setuptools from the package index on every run (20 s to minutes on a slow index).
test: venv system-deps
	$(PIP) install -q --force-reinstall --no-deps --no-build-isolation ./tests/example_plugin \
		2>/dev/null || $(PIP) install -q --force-reinstall --no-deps ./tests/example_plugin
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
		$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadgroup $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .

# The control API's reference, generated from rpc.discover (tests/rpc/test_reference.py checks it).
docs: venv
	$(PY) -m dedloc.daemon.reference --output docs/rpc-reference.md

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info tests/example_plugin/build
