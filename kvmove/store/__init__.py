"""The store side: the Mooncake client adapter (:mod:`.mooncake_store`, ``MooncakeStore``),
its configuration (:mod:`.config`, ``StoreConfig``) and the embedded master
(:mod:`.embedded_master`). Descriptors come in from :mod:`kvmove.objects.descriptors`; statuses go
out as :class:`kvmove.Status`."""
