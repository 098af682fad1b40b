VENV ?= .venv
export VENV

.PHONY: demo test lint bench bootstrap

bootstrap:
	@scripts/bootstrap

demo: bootstrap
	@scripts/demo

test: bootstrap
	@scripts/bootstrap-vllm
	@scripts/bootstrap-sglang
	@scripts/bootstrap-routers
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

lint: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	scripts/typecheck

bench: bootstrap
	@scripts/bootstrap-vllm
	$(VENV)/bin/python benchmarks/status_fanout.py
	$(VENV)/bin/python benchmarks/status_time.py
	$(VENV)/bin/python benchmarks/store_scale.py
	$(VENV)/bin/python benchmarks/client_capacity.py
	$(VENV)/bin/python benchmarks/bench_vs_vllm.py
	$(VENV)/bin/python benchmarks/cutover_under_load.py
	$(VENV)/bin/python benchmarks/rolling_capacity.py
	$(VENV)/bin/python benchmarks/status_fleet.py
