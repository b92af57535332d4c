"""Moving rows between row pools: the pools (:mod:`.pool`), index validation
(:mod:`.indices`), prepared copies (:mod:`.prepared`) and the backends that run them (torch,
the Triton kernel, the two-hop copy-engine path). The public entry points are
:func:`kvmove.gather`, :func:`kvmove.scatter` and :func:`kvmove.copy_rows`."""
