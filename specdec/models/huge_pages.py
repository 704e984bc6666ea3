"""Quantized weights in memory that Linux may back with 2 MB pages.

A decode step streams every weight once: 1 GB for qwen2.5-coder-1.5b in 4 bits, 250,000 pages
of 4 KB, each a TLB miss and a page walk, and the hardware prefetchers stop at each 4 KB page's
end. Anonymous memory advised MADV_HUGEPAGE gets transparent huge pages wherever the system
allows them for regions that ask (the `madvise` mode, Linux's default, and `always`); heap
allocations do not ask. In one process on the 2-core EPYC, the same model's weights taking turns
between this mapping and heap copies, 12 rounds of 48 tokens: 31.5 against 24.8 tok/s in the
median, 35.0 against 29.6 at best (bench/investigations/cpu_huge_pages.py,
bench/results/cpu_huge_pages_20261207.json). Where the advice is not available (not Linux) the
weights stay where they are; where the system refuses huge pages it costs nothing.
"""

from __future__ import annotations

import mmap

import torch

from specdec.models.heap import trim_heap
from specdec.models.quant_linear import QuantWeight

HUGE_PAGE = 1 << 21
ALIGN = 64  # each tensor's start, as the kernels' vector loads like it
TRIM_EVERY = 64 << 20  # bytes moved between handing the freed originals back to the system


def rehome(weights: list[QuantWeight]) -> mmap.mmap | None:
    """Move the weights' tensors (codes, scales, offsets) into one anonymous mapping advised
    MADV_HUGEPAGE, 2 MB aligned, each tensor replaced in place by its copy there (the
    original is freed as the next is copied, so resident memory grows by one tensor at most).
    Returns the mapping, which must live as long as the weights (None: nothing moved)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    fields = [(w, f) for w in weights for f in ("qs", "d", "mn") if getattr(w, f) is not None]
    if advice is None or not fields:
        return None
    sizes = [-(-getattr(w, f).nbytes // ALIGN) * ALIGN for w, f in fields]
    arena = mmap.mmap(-1, sum(sizes) + HUGE_PAGE,
                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        arena.madvise(advice)
    except OSError:  # a kernel without transparent huge pages: ordinary pages, same layout
        pass
    buf = torch.frombuffer(arena, dtype=torch.uint8)
    at = (-buf.data_ptr()) % HUGE_PAGE
    freed = 0
    for (w, f), size in zip(fields, sizes):
        t = getattr(w, f)
        home = buf[at:at + t.nbytes].view(t.dtype).view(t.shape)
        home.copy_(t)
        setattr(w, f, home)
        at += size
        freed += t.nbytes
        del t
        if freed >= TRIM_EVERY:
            # glibc keeps freed heap pages (and serves blocks up to 32 MB from the heap once
            # large ones were freed): without handing them back as it goes, the server's
            # peak resident memory grew from 3.2 to 3.9 GB.
            trim_heap()
            freed = 0
    trim_heap()
    return arena
