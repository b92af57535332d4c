"""What a get that fails leaves in its destination (a measurement, not a benchmark): on the
in-place path the destination is the KV rows themselves.

A holder process stores ``--keys`` objects of ``--mib`` MiB in its own segment; this
process (no segment of its own, so every object is read from the holder over TCP) fills a
destination with a pattern and gets the objects into it through ``kvmove.MooncakeStore``,
while the holder is SIGKILLed ``--kill-after`` seconds into the get (``-1``: before it). For
each key it prints the status, Mooncake's code, and how many destination bytes changed.
First: a get of a missing key, and of objects one byte smaller and one byte larger than
the destination.

    python -m bench.partial_get [--keys 8] [--mib 32] [--kill-after 0.03]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import threading
import time

import kvmove
from kvmove.memory.host_memory import HostMemory

HOLDER = textwrap.dedent("""
    import sys, time, torch, kvmove
    from kvmove.memory.host_memory import HostMemory
    address, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = kvmove.MooncakeStore(kvmove.StoreConfig(master_address=address,
        local_hostname="127.0.0.1", global_segment_size=max(1 << 30, 2 * n * size)))
    src = HostMemory(size, pin=None)
    src.tensor.copy_(torch.arange(size) % 251)  # never the destination's pattern (0x5A)...
    src.tensor[src.tensor == 0x5A] = 0x5B  # ...so every byte written shows
    desc = kvmove.Descriptors([f"obj{i}" for i in range(n)], [[src.address]] * n, [[size]] * n,
                              regions=[(src.address, size)])
    print("stored", set(s.value for s in store.put(desc)), flush=True)
    time.sleep(600)
""")
PATTERN = 0x5A


def changed(memory: HostMemory, i: int, size: int) -> int:
    return int((memory.tensor[i * size:(i + 1) * size] != PATTERN).sum())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.partial_get",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=8)
    p.add_argument("--mib", type=int, default=32, help="object size")
    p.add_argument("--kill-after", type=float, default=0.03,
                   help="seconds into the get (-1: before it)")
    args = p.parse_args(argv)
    n, size = args.keys, args.mib << 20
    with kvmove.MooncakeStore.embedded(global_segment_size=64 << 20) as store:
        reader = kvmove.MooncakeStore(kvmove.StoreConfig(
            master_address=store.address, local_hostname="127.0.0.1", global_segment_size=0))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.abspath(kvmove.__file__))),
             os.environ.get("PYTHONPATH", "")])}
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, store.address, str(n),
                                   str(size)], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env=env)
        dst = HostMemory(n * size, pin=None)
        try:
            print("holder:", holder.stdout.readline().strip())
            # Failures checked before any transfer, from this process's own objects.
            own = HostMemory(3 * 4096 + 1, pin=None)
            put = kvmove.Descriptors(["small", "large"], [[own.address], [own.address]],
                                     [[4095], [4097]], regions=[(own.address, own.nbytes)])
            stored = store.put(put)
            assert stored.all_ok, stored.summary()
            dst.tensor[: 3 * 4096].fill_(PATTERN)
            ask = kvmove.Descriptors(["missing", "small", "large"],
                                     [[dst.address + i * 4096] for i in range(3)],
                                     [[4096]] * 3, regions=[(dst.address, dst.nbytes)])
            got = store.get(ask)
            for i, key in enumerate(ask.keys):
                print(f"  {key}: {got[i].value} ({got.codes[i]}), "
                      f"{changed(dst, i, 4096)} of 4096 destination bytes changed")
            store.unregister([(own.address, own.nbytes)])
            dst.tensor.fill_(PATTERN)
            desc = kvmove.Descriptors([f"obj{i}" for i in range(n)],
                                      [[dst.address + i * size] for i in range(n)],
                                      [[size]] * n, regions=[(dst.address, dst.nbytes)])
            if args.kill_after < 0:
                holder.kill()
                holder.wait()
            else:
                threading.Timer(args.kill_after, holder.kill).start()
            t0 = time.perf_counter()
            got = reader.get(desc)
            print(f"get of {n} x {args.mib} MiB from the holder, killed "
                  f"{'before the get' if args.kill_after < 0 else f'{args.kill_after}s in'}: "
                  f"{(time.perf_counter() - t0) * 1e3:.0f} ms")
            for i, (st, code) in enumerate(zip(got, got.codes, strict=True)):
                print(f"  obj{i}: {st.value} ({code}), {changed(dst, i, size)} of {size} "
                      f"destination bytes changed")
        finally:
            if holder.poll() is None:
                holder.kill()
            holder.wait()
            reader.close()
            store.unregister([(dst.address, dst.nbytes)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
