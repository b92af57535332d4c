"""Prefill -> decode host memory, directly: a decode process opens its host pool as a
:class:`~kvmove.PageReceiver` (its pool registered with a Mooncake Transfer Engine, a
handle published), a prefill process's :class:`~kvmove.PageSender` gathers pages of its KV
cache into staging and writes them into the pages the decode side names, one network hop.

Modules, bottom up: ``engine`` (the Transfer Engine, its settings), ``handle`` (what a
receiver publishes), ``spans`` (what goes where, merged, in calls the transport handles),
``slots`` (staging slots per layer), ``job``, ``link`` (one engine and one thread per
receiver, its calls watched by the store's :class:`~kvmove.store.bounded_call.Watchdog`),
``receiver``, ``sender``.
"""
