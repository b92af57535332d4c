"""Memory, the bottom of the data path: the engine's KV cache (:mod:`.cache`), host staging
(:mod:`.staging`, with its slot allocator and page-aligned, pinned :mod:`.host_memory`),
engine-owned host pools (:mod:`.host_pool`), and the row pool that every copy reads and
writes (:mod:`.row_pool`). CUDA calls outside torch go through :mod:`.cuda_api`."""
