"""Tests that need an engine installed in its own venv (see scripts/test_sglang.sh)."""
