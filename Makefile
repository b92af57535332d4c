.PHONY: setup demo test bench lint

setup:
	bash scripts/setup.sh

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

bench: setup
	bash scripts/test_sglang.sh --setup-only
	bash scripts/test_vllm.sh --setup-only
	.venv/bin/python -m bench.run_all --report

lint: setup
	.venv/bin/ruff check .
