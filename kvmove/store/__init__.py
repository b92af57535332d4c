"""The store side: the Mooncake client adapter (:mod:`.mooncake_store`, ``MooncakeStore``) and
its parts (statuses, client replacement, registration, the pending put, failover), its
configuration (:mod:`.config`, ``StoreConfig``), the embedded master (:mod:`.embedded_master`)
and the ``Store`` protocol (:mod:`.protocol`). Descriptors come in from
:mod:`kvmove.objects.descriptors`; statuses go out as :class:`kvmove.Status`."""
