"""Engine integrations: each module imports its engine only when it is itself imported, so
the engine is never a dependency of kvmove."""
