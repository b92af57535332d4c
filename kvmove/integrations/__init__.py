"""Integrations of kvmove with inference engines. Each engine's integration lives in its own
module and imports that engine only when it is used (``kvmove.integrations.vllm``)."""
