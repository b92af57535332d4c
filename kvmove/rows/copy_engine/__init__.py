"""The copy-engine backend of row moves: span copies with ``cudaMemcpyBatchAsync``, the
two-hop path through a device ring."""
