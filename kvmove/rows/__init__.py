"""Moving rows between row pools (:mod:`kvmove.memory.row_pool`), above memory and below
descriptors: prepared copies (:mod:`.prepared`), their plans (:mod:`.plan`), the backends
that run them (torch, the Triton kernel, the two-hop copy-engine path) and the launch-config
lookup. The public entry points are :func:`kvmove.gather`, :func:`kvmove.scatter` and
:func:`kvmove.copy_rows` (:mod:`.moves`)."""
