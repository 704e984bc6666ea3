"""Handing freed heap memory back to the operating system (glibc keeps it otherwise)."""

from __future__ import annotations


def release_freed_memory() -> None:
    """Hand the heap memory freed by loading (conversion temporaries) back to the OS. glibc
    keeps it otherwise: the default server held 0.85 GB more resident memory without this."""
    import gc

    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Return the free pages of every malloc arena to the OS (glibc's malloc_trim; a no-op
    elsewhere). The server calls it whenever its engine falls idle: steps leave freed
    temporaries behind in each thread's arena, a few hundred MB over a dozen requests."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
