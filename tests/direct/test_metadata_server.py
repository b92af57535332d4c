"""The direct path with a metadata server (``MOONCAKE_TE_META_DATA_SERVER``, here Mooncake's
own HTTP metadata server) instead of ``P2PHANDSHAKE``: an engine's name is its key there and
a second engine of the same name is refused, so every engine kvmove makes beside others
(two receivers and a sender's engine per receiver, all in this process, all given the same
host) takes a name of its own, and every page lands."""

from __future__ import annotations

import torch

import kvmove
from kvmove.store.transfer_engine import TransportSettings

PAGE_TOKENS, PAGES, LAYERS, ROW = 4, 8, 3, 656


def test_engines_named_apart_keep_the_host_and_differ_in_port():
    p2p = TransportSettings(local_hostname="10.0.0.7")
    assert p2p.named_apart() is p2p  # P2PHANDSHAKE gives each engine its own port anyway
    served = TransportSettings(local_hostname="10.0.0.7:5000",
                               metadata_server="http://meta:8080/metadata")
    a, b = served.named_apart(), served.named_apart()
    assert served.has_port and not TransportSettings(local_hostname="node-1").has_port
    assert a.host == b.host == "10.0.0.7" and a.has_port and b.has_port
    assert a.local_hostname != b.local_hostname
    assert TransportSettings(local_hostname="[::1]", metadata_server="http://m/x"
                             ).named_apart().host == "[::1]"


def test_one_sender_writes_two_receivers_through_a_metadata_server(metadata_server):
    g = torch.Generator().manual_seed(5)
    kv = kvmove.KVCache({"kv": [torch.randint(0, 256, (64, ROW), dtype=torch.uint8,
                                              generator=g) for _ in range(LAYERS)]})
    pools = [kvmove.HostPool({"kv": torch.zeros(LAYERS, PAGES * PAGE_TOKENS, ROW,
                                                dtype=torch.uint8)},
                             page_tokens=PAGE_TOKENS, layout="layer_first")
             for _ in range(2)]
    receivers = [kvmove.PageReceiver(pool, hostname="127.0.0.1") for pool in pools]
    try:
        assert receivers[0].peer != receivers[1].peer  # names of their own, same host
        token_pages = torch.arange(8, 16).view(2, PAGE_TOKENS)
        with kvmove.PageSender(kv, page_tokens=PAGE_TOKENS, staging_slots=8,
                               hostname="127.0.0.1") as tx:
            for rx, dst in zip(receivers, ([1, 5], [0, 7]), strict=True):
                assert tx.send(rx.handle, token_pages, torch.tensor(dst)).wait() == \
                    [kvmove.Status.OK] * 2
        for pool, dst in zip(pools, ([1, 5], [0, 7]), strict=True):
            landed = pool.tensor("kv").view(LAYERS, PAGES, PAGE_TOKENS, ROW)
            for i, page in enumerate(dst):
                for layer in range(LAYERS):
                    assert torch.equal(landed[layer, page], kv.layer("kv", layer)[
                        token_pages[i]].view(PAGE_TOKENS, ROW))
    finally:
        for rx in receivers:
            rx.close()
