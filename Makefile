# One way to set up and run everything. Each target sets up what it needs (idempotent).
.PHONY: setup test lint demo gpu-test

setup:
	bash scripts/setup.sh

test: setup
	.venv/bin/ruff check src tests tools benchmarks
	.venv/bin/python -m pytest -q -p no:cacheprovider tests

lint: setup
	.venv/bin/ruff check src tests tools benchmarks
	.venv/bin/ruff format --check src tests tools benchmarks

gpu-test: setup
	.venv/bin/python -m pytest -q tests/gpu

demo: setup
	.venv/bin/python -m fastplms.cli.demo
