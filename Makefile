# Two entry points (see README Quickstart): `make run` and `make test`. Both set up .venv first.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.flowrl-installed
EXTRAS  ?= dev,ray,deepspeed,wandb,mlflow,tensorboard,lora
# torch is pinned by constraints.txt so a CPU machine never pulls the CUDA build (see README).
PIP     := $(BIN)/pip install -q -c constraints.txt

.PHONY: setup run test lint typecheck bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@command -v dot >/dev/null 2>&1 || { (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) \
	  || echo "note: could not install graphviz's 'dot' (apt-get install graphviz / brew install graphviz); flowrl viz can still write .dot"; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e '.[$(EXTRAS)]'
	touch $(STAMP)

run: setup
	$(BIN)/flowrl run examples/grpo_arith.flow --out runs/grpo_arith --overwrite

lint: setup
	$(BIN)/ruff check .

typecheck: setup
	$(BIN)/mypy -p flowrl

# The suite runs on TEST_WORKERS pytest-xdist workers, which take its tests one at a time in the order tests/conftest.py
# sets (`loadgroup`'s hand-out: with pytest 9, xdist 3.8's `xdist_group` marks group nothing, so no test is pinned to
# a worker). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

test: lint typecheck
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not autoscaling" --durations=25 \
	  -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
	$(BIN)/python -m pytest -q -p no:cacheprovider -m autoscaling

# TRL lives in its own venv (bench/.venv-trl, gitignored), never in .venv; created on first use.
bench: setup
	test -x bench/.venv-trl/bin/python || $(PY) -m venv bench/.venv-trl
	test -f bench/.venv-trl/.trl-installed || { bench/.venv-trl/bin/pip install -q -c constraints.txt torch==2.13.0 \
	  && bench/.venv-trl/bin/pip install -q -c constraints.txt trl==1.16.0 -e . && touch bench/.venv-trl/.trl-installed; }
	$(BIN)/python bench/gen_speed.py
	$(BIN)/python bench/grpo_vs_trl.py --shape short
	$(BIN)/python bench/grpo_vs_trl.py --shape fewshot

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
