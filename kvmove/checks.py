"""Argument checks shared by several modules (a check only one module uses lives there):
public entry points validate their arguments once, before anything is written. Each check
raises ``TypeError`` / ``ValueError`` / ``IndexError`` naming the argument and the first
bad value.

Checks of index tensors run on the host only: a tensor on a device would have to be waited
for, so callers leave those to the kernel's error counter.
"""

from __future__ import annotations

import functools
import numbers
import threading
from collections.abc import Sequence

import numpy as np
import torch

INDEX_DTYPES = (torch.int32, torch.int64)
INDEX_NUMPY_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
# Up to this many rows, index checks run on Python lists (fewer fixed costs than numpy's).
SMALL_ROWS = 256
# check_unique marks values in a table of flags (instead of sorting them) where the values'
# bound is at most this many times their count.
UNIQUE_TABLE_PER_ROW = 16


def check_index_array(value: np.ndarray, name: str, *, dim: int) -> np.ndarray:
    """``value``, a numpy array, if it is int32/int64 of ``dim`` dimensions; else a clear
    error naming ``name``."""
    if value.dtype not in INDEX_NUMPY_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got dtype {value.dtype}")
    if value.ndim != dim:
        raise ValueError(f"{name} must have {dim} dimension(s), got shape {value.shape}")
    return value


def as_index_tensor(value, name: str, *, dim: int, device: torch.device | None = None
                    ) -> torch.Tensor:
    """``value`` as an int32/int64 tensor of ``dim`` dimensions, on the CPU or ``device``,
    or a clear error naming ``name``. Lists and tuples of ints are accepted (int64), and
    numpy int32/int64 arrays (on the CPU, sharing their memory unless read-only or with a
    negative stride, which torch cannot view)."""
    if isinstance(value, np.ndarray):
        value = check_index_array(value, name, dim=dim)
        shared = value.flags.writeable and min(value.strides, default=0) >= 0
        return torch.from_numpy(value if shared else value.copy())
    if not isinstance(value, torch.Tensor):
        if isinstance(value, (list, tuple)):
            rows = value if dim == 2 else [value]
            if not all(isinstance(row, (list, tuple)) for row in rows) or not all(
                isinstance(x, numbers.Integral) and not isinstance(x, bool)
                for row in rows for x in row
            ):
                raise TypeError(f"{name} must hold integers in {dim} dimension(s), "
                                f"got {value!r:.80}")
            try:
                value = torch.tensor(value, dtype=torch.int64)
            except (RuntimeError, ValueError, OverflowError) as e:
                raise ValueError(f"{name} is not a valid index list: {e}") from None
            if value.numel() == 0:
                value = value.reshape((0,) * dim if dim == 1 else (0, 0))
        else:
            raise TypeError(f"{name} must be an int32/int64 tensor, got {type(value).__name__}")
    if value.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got dtype {value.dtype}")
    if value.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimension(s), got shape {tuple(value.shape)}")
    if not value.is_cpu and value.device != device:
        raise ValueError(
            f"{name} is on {value.device}; indices must be on the CPU"
            + (f" or {device}" if device is not None and device.type != "cpu" else "")
        )
    return value


def host_values(rows: torch.Tensor | np.ndarray) -> np.ndarray:
    """The flat values of a CPU index tensor, as a numpy view (small arrays cost a fraction
    of what torch ops do per call); ``TypeError`` for a tensor on a device."""
    if isinstance(rows, np.ndarray):
        return rows.reshape(-1)
    if rows.device.type != "cpu":
        raise TypeError(f"host-side index check of a tensor on {rows.device}")
    return rows.reshape(-1).numpy()


def check_range(rows: torch.Tensor, limit: int, name: str) -> None:
    """Every entry is ``-1`` or in ``[0, limit)``; else ``IndexError`` with the first bad
    value and its position."""
    if rows.numel() == 0:
        return
    a = host_values(rows)
    if int(a.min()) >= -1 and int(a.max()) < limit:
        return
    pos = int(np.flatnonzero((a < -1) | (a >= limit))[0])
    raise IndexError(
        f"{name}[{pos}] = {int(a[pos])} is out of range: valid values are -1 "
        f"(skip) and 0..{limit - 1}"
    )


def has_repeats(values: np.ndarray) -> bool:
    """Whether some value of the 1-D ``values`` occurs more than once. Sorts a copy:
    ``np.unique`` would import ``numpy.ma`` on its first call in a process (numpy 2.x,
    7 ms measured), and that call would be a transfer's, while serving."""
    if values.size < 2:
        return False
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def check_unique(rows: torch.Tensor | np.ndarray | list[int], name: str, *,
                 page_tokens: int = 1, limit: int | None = None, skips: bool = True) -> None:
    """No destination row named twice (``-1`` excepted): the result would depend on order.
    ``rows`` may be page numbers of whole pages of ``page_tokens`` rows (the message names
    the page's first row), or a list of them (a few pages: a set costs less than numpy's
    calls, the more so on cold caches). ``limit``: every value is known to be ``-1`` or
    below it (checked already): where it is not many times the count, one mark per value
    in a table of ``limit`` flags replaces the sort. ``skips=False``: no value is ``-1``
    (checked already), so none is counted."""
    if isinstance(rows, list):
        if len(set(rows)) == len(rows):
            return
        rows = np.array(rows, dtype=np.int64)
    a = host_values(rows)
    n = a.shape[0]
    if n < 2:
        return
    if limit is not None and limit <= UNIQUE_TABLE_PER_ROW * n:
        # One mark per value, no mask of the kept ones made: a -1 marks the extra last
        # flag. Distinct where the rows marked are as many as the rows not -1 (no
        # "increasing" pre-test either: scattered rows, the usual case here, fail it).
        seen = np.zeros(limit + 1, dtype=np.bool_)
        seen[a] = True
        if int(np.count_nonzero(seen[:limit])) == (
                n - int(np.count_nonzero(a < 0)) if skips else n):
            return  # (else the sort below names the first repeat)
    elif bool((a[1:] > a[:-1]).all()):  # strictly increasing: no sort
        return
    kept = np.sort(a[a >= 0])
    dups = kept[1:][kept[1:] == kept[:-1]]
    if dups.size:
        raise ValueError(f"{name} names row/slot {int(dups[0]) * page_tokens} more than "
                         "once; destinations must be unique")


def as_int_array(value, name: str) -> np.ndarray:
    """``value`` (tensor, array or sequence of ints) as a 1-D int64 numpy array."""
    if type(value) is np.ndarray and value.dtype == np.int64 and value.ndim == 1:
        return value  # already one (page numbers worked out by kvmove, say)
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise TypeError(f"{name} must hold integers, got a tensor of {value.dtype}")
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        if value.is_meta:
            raise TypeError(f"{name} must be a tensor with data, got a meta tensor")
        if not value.is_cpu or value.requires_grad:
            value = value.detach().cpu()
        return value.numpy().astype(np.int64, copy=False)
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must hold integers, got {type(value).__name__} {value!r}")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:
        raise TypeError(f"{name} must be a sequence of integers, got {value!r:.80} ({e})") \
            from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got {type(value).__name__} of shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer) or (
        arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max
    ):
        items = value if isinstance(value, (list, tuple)) else arr.tolist()
        bad = next((v for v in items if isinstance(v, bool) or not isinstance(v, int)
                    or not -(2**63) <= v < 2**63), arr[0])
        raise TypeError(f"{name} must hold int64 integers, got {bad!r:.40}")
    return arr.astype(np.int64, copy=False)


def check_positive_int(value, name: str) -> int:
    """``value`` when it is an int > 0 (not a bool); else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_layout(layout, allowed: Sequence[str], name: str = "layout") -> str:
    """``layout`` after checking that it is one of ``allowed``."""
    if layout not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {layout!r}")
    return layout


def check_keys(keys: Sequence[str], name: str = "keys", *, unique: bool = True) -> list[str]:
    """``keys`` as a new list, after checking that it is a sequence of non-empty ``str``
    (and, with ``unique``, that no key repeats). Raises ``TypeError`` / ``ValueError``
    naming ``name`` and the offending key."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, (Sequence, np.ndarray)):
        raise TypeError(
            f"{name} must be a sequence of str, got {type(keys).__name__}"
            + (" (wrap a single key in a list)" if isinstance(keys, str) else "")
        )
    keys = list(keys)
    try:
        "".join(keys)  # one pass in C, which stops at the first item that is not a str
    except TypeError:
        for i, k in enumerate(keys):
            if not isinstance(k, str):
                raise TypeError(f"{name}[{i}] must be a str, got {type(k).__name__} {k!r}") \
                    from None
    distinct = set(keys)
    if "" in distinct:
        raise ValueError(f"{name}[{keys.index('')}] is an empty string; keys must be non-empty")
    if unique and len(distinct) != len(keys):
        seen: set[str] = set()
        for i, k in enumerate(keys):
            if k in seen:
                raise ValueError(f"{name}[{i}] = {k!r} repeats an earlier key; keys must be unique")
            seen.add(k)
    return keys


@functools.lru_cache(maxsize=256)
def _same_valid(n: int, valid: int) -> np.ndarray:
    """``n`` times ``valid`` (int64), read-only: one array for every call of that size."""
    arr = np.full(n, valid, dtype=np.int64)
    arr.flags.writeable = False
    return arr


def check_valid_tokens(valid_tokens, n: int, page_tokens: int) -> np.ndarray:
    """One int64 ``valid_tokens`` per key. For ``None`` (whole pages) or one int the array is
    read-only and shared between calls (a mover's call returns in tens of µs; a new array
    is a visible part of that)."""
    if valid_tokens is None:
        return _same_valid(n, page_tokens)
    if isinstance(valid_tokens, (bool, float, np.bool_, np.floating)):
        raise TypeError(f"valid_tokens must be an int or one int per key, got {valid_tokens!r}")
    if isinstance(valid_tokens, (int, np.integer)) or (
        isinstance(valid_tokens, torch.Tensor) and valid_tokens.dim() == 0
    ):
        if isinstance(valid_tokens, torch.Tensor) and (
            valid_tokens.is_floating_point() or valid_tokens.dtype == torch.bool
        ):
            raise TypeError(f"valid_tokens must be an int, got a {valid_tokens.dtype} tensor")
        v = int(valid_tokens)
        if not 1 <= v <= page_tokens:
            raise ValueError(f"valid_tokens = {v} is outside 1..{page_tokens} (page_tokens)")
        return _same_valid(n, v)
    arr = as_int_array(valid_tokens, "valid_tokens")
    if arr.size != n:
        raise ValueError(f"valid_tokens has {arr.size} entries for {n} keys; give one per key")
    if n:
        bad = np.flatnonzero((arr < 1) | (arr > page_tokens))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"valid_tokens[{i}] = {int(arr[i])} is outside 1..{page_tokens} (page_tokens)"
            )
    return arr


def page_numbers(token_indices, page_tokens: int, num_pages: int, name: str, *,
                 few_as_list: bool = False) -> np.ndarray | list[int]:
    """int64 page numbers of ``token_indices`` (``n * page_tokens`` token slots, page by
    page): the first slot of each page, which must start a page. Raises ``ValueError`` for a
    length that is not whole pages, or a page that does not start at a page boundary, and
    ``IndexError`` for a page outside ``0 .. num_pages - 1``; each names ``name`` and the
    bad index. ``few_as_list``: a few pages (a tensor of up to :data:`SMALL_ROWS` indices)
    come as a list of ints, which is what they are worked out in."""
    p = page_tokens
    if (type(token_indices) is torch.Tensor and token_indices.dim() == 1
            and token_indices.numel() <= SMALL_ROWS and token_indices.is_cpu
            and token_indices.dtype in INDEX_DTYPES):
        pages = _small_page_numbers(token_indices.tolist(), p, num_pages)
        if pages is not None:
            return pages if few_as_list else np.array(pages, dtype=np.int64)
    idx = as_int_array(token_indices, name)
    if idx.size % p:
        raise ValueError(f"{name} has {idx.size} entries, not a whole number of pages of "
                         f"{p} tokens")
    if p == 1:  # every index starts a page: it is its page
        pages = first = idx.copy()  # (not a view of the caller's tensor)
    else:
        first = idx[::p]
        bad = np.flatnonzero(first % p)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name}[{i * p}] = {int(first[i])} does not start a page of "
                             f"{p} tokens")
        pages = first // p
    if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        i = int(np.flatnonzero((pages < 0) | (pages >= num_pages))[0])
        raise IndexError(f"{name}[{i * p}] = {int(first[i])} is page {int(pages[i])}, "
                         f"outside the pool's {num_pages} pages")
    return pages


def _small_page_numbers(idx: list[int], page_tokens: int, num_pages: int) -> list[int] | None:
    """:func:`page_numbers` of a few indices, in Python (fewer fixed costs than numpy's
    calls); None where they are not whole pages in range (the numpy path then says why)."""
    if len(idx) % page_tokens:
        return None
    pages = idx if page_tokens == 1 else idx[::page_tokens]
    if page_tokens > 1:
        if any(first % page_tokens for first in pages):
            return None
        pages = [first // page_tokens for first in pages]
    if pages and (min(pages) < 0 or max(pages) >= num_pages):
        return None
    return pages


def small_rows_ok(rows: np.ndarray, limit: int, *, unique: bool) -> bool:
    """For a few rows (in Python: fewer fixed costs than numpy's calls), whether every row is
    ``-1`` or in ``[0, limit)`` and, with ``unique``, no row repeats. False also where there
    are too many rows to look at this way: then the numpy checks decide."""
    if rows.size > SMALL_ROWS:
        return False
    flat = rows.ravel().tolist()
    low = min(flat)
    if low < -1 or max(flat) >= limit:
        return False
    if unique:
        kept = flat if low >= 0 else [r for r in flat if r >= 0]
        return len(set(kept)) == len(kept)
    return True


def check_seconds(value, name: str, *, none_ok: bool = False, zero_ok: bool = False):
    """``value`` as float seconds: a real number > 0 (>= 0 with ``zero_ok``; ``None`` passes
    with ``none_ok``) and at most ``threading.TIMEOUT_MAX`` (a longer wait, ``inf`` included,
    overflows the waits: say ``None`` for no limit where it is allowed); else ``ValueError``
    naming ``name``."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            (value >= 0 if zero_ok else value > 0) and value <= threading.TIMEOUT_MAX):
        raise ValueError(f"{name} must be {'>= 0' if zero_ok else 'positive'} seconds, at "
                         f"most {threading.TIMEOUT_MAX:g}{' (or None)' if none_ok else ''}, "
                         f"got {value!r}")
    return float(value)
