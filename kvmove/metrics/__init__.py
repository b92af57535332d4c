"""kvmove's metrics in Prometheus' conventions: ``kvmove_*`` families of bytes moved, the
time they took, statuses, host and copy time, staging, paths and failovers. Off unless
asked (:func:`enable`, :func:`serve`, ``KVMOVE_METRICS_PORT``); every level records
through :mod:`kvmove.metrics.record`. Names, units, labels: ``docs/METRICS.md``."""

from kvmove.metrics.switch import ENV_PORT, disable, enable, enable_from_env, enabled, serve

__all__ = ["ENV_PORT", "disable", "enable", "enable_from_env", "enabled", "serve"]
