"""Handing the C heap's free pages back to the operating system.

glibc keeps freed chunks in its heaps (one per thread that allocated, up to 8 x cores) once its dynamic mmap
threshold has risen, so memory a burst of work freed stays in the process's RSS: the float32 layers replaced while
packing weights (docs/design.md#mask-row-adapter, "Memory at start-up"), or the automata llguidance built for a grammar
it then gave up on in a worker thread (about 170 MB per refused ``^(q{1000}){1000}$``;
docs/design.md#constrained-decoding). ``malloc_trim(0)`` returns those pages from every heap.
"""
from __future__ import annotations

_TRIM = False  # not looked up yet; None where the C library has no malloc_trim


def return_freed_memory() -> None:
    """Give the C heaps' free pages back to the system (glibc ``malloc_trim(0)``; nothing where the C library has
    none: musl, macOS, Windows). Costs milliseconds on a heap of hundreds of MB."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _malloc_trim():
    global _TRIM
    if _TRIM is False:
        import ctypes

        try:
            _TRIM = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError, TypeError):  # no malloc_trim (musl, macOS); CDLL(None) on Windows
            _TRIM = None
    return _TRIM
