"""SGLang interop tests (run by scripts/test_sglang.sh in .venv-sglang)."""
