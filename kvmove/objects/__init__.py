"""The object level: what a stored object is made of (``Descriptors``, the keys a page is
stored under, its checksum) and the in-place rows that let the store read the KV cache
itself."""
