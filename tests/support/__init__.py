"""Helpers shared by the tests, apart from the tests themselves: KV caches and hypothesis
strategies (:mod:`.caches`), staging buffers of random bytes and their canonical objects
(:mod:`.staging_data`), what ``/proc`` says about processes, sockets and memory
(:mod:`.process_table`), whether the Triton interpreter runs kernels here
(:mod:`.interpreter`), and what a store has registered (:mod:`.store_state`)."""
