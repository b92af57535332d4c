"""The mapped-memory check (:mod:`kvmove.memory.mapped`): read+write host mappings only,
each region inside one run of them."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest

from kvmove.memory.host_memory import HostMemory
from kvmove.memory.mapped import check_mapped, parse_maps, unusable

MAPS = """\
00400000-00401000 r-xp 00000000 08:01 1 /usr/bin/python
00401000-00402000 rw-p 00001000 08:01 1 /usr/bin/python
00402000-00404000 rw-p 00000000 00:00 0 [heap]
00500000-00501000 r--p 00000000 00:00 0
00600000-00602000 rw-s 00000000 00:05 7 /dev/shm/x
00602000-00603000 ---p 00000000 00:00 0
"""


def test_parse_maps_keeps_read_write_ranges_and_merges_touching_ones():
    starts, ends = parse_maps(MAPS)
    assert starts.tolist() == [0x401000, 0x600000]
    assert ends.tolist() == [0x404000, 0x602000]


@pytest.mark.parametrize(("region", "ok"), [
    ((0x401000, 0x3000), True),  # across two touching rw mappings
    ((0x403fff, 1), True),
    ((0x403fff, 2), False),  # one byte past the run's end
    ((0x404000, 1), False),
    ((0x400000, 16), False),  # read-only code
    ((0x500000, 16), False),  # read-only data
    ((0x601000, 0x1001), False),  # into a ---p guard page
    ((0x1000, 4096), False),
    ((0x401000, 0), False),
])
def test_unusable_finds_regions_outside_read_write_memory(region, ok):
    maps = parse_maps(MAPS)
    assert (unusable([region], maps) is None) == ok
    assert unusable([(0x401000, 16), region], maps) == (None if ok else region)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_check_mapped_against_this_process():
    memory = HostMemory(8192, pin=None)
    array = np.zeros(100, dtype=np.uint8)
    check_mapped([(memory.address, 8192), (array.ctypes.data, 100)])
    with pytest.raises(ValueError, match=r"region 0x1000 \+ 4096 bytes"):
        check_mapped([(memory.address, 8192), (0x1000, 4096)])
    # a mapping whose second page is made inaccessible: the first page passes, both do not
    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + page, page, mmap.PROT_READ) == 0
    try:
        check_mapped([(base, page)])
        with pytest.raises(ValueError, match=rf"{base:#x} \+ {page + 1} bytes"):
            check_mapped([(base, page + 1)])
    finally:
        libc.mprotect(base + page, page, mmap.PROT_READ | mmap.PROT_WRITE)
