"""Engine integrations, one package per engine (``kvmove.integrations.sglang``,
``kvmove.integrations.vllm``), on top of the public API. Each imports its engine only in the
modules that plug into it, so the engine is never a dependency of kvmove."""
