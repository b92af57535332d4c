"""Engine integrations (``kvmove.integrations.sglang``, ``kvmove.integrations.vllm``): each
module imports its engine only when it is itself imported, so the engine is never a
dependency of kvmove."""
