"""Peak memory of a block of code, on CPU and CUDA.

On CPU, the kernel's high-water mark of the resident set, ``VmHWM`` in
``/proc/self/status``: before each measured phase, memory that the C allocator
holds free is handed back (``gc.collect(1)``, then glibc's ``malloc_trim(0)``;
otherwise a phase would reuse a warm-up pass's freed pages without its resident
set growing, and read low), the mark is reset to the current resident set
(writing ``5`` to ``/proc/self/clear_refs``, Linux >= 4.0), and after the phase
the mark is read. Two figures are kept:

- ``peak_rss_bytes``: the process's peak resident set during the phase
  (the Python interpreter, torch and the model included);
- ``peak_extra_bytes``: that peak minus the resident set at the start of the
  phase, i.e. the memory the phase itself needed (activations, gradients, the
  site graph, optimizer state, allocator slack).

Ratios use ``peak_extra_bytes`` (the interpreter's ~0.3 GB would otherwise
dominate every ratio). Where ``clear_refs`` cannot be written (not Linux), the
fallback is ``getrusage(RUSAGE_SELF).ru_maxrss`` since the process started, an
upper bound; the report names the method it used (``memory_method``). On CUDA the figures are
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.

:func:`resident_bytes` and :func:`heap_stats` read the resident set and glibc's heap now, and
:func:`take_peak_resident_bytes` the peak resident set since its last call
(``benchmarks/bench_train_memory.py`` follows them through training).
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource

import torch


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def release_free_memory() -> None:
    """Return the allocator's free pages to the kernel, so the resident set is the live memory (glibc only)."""
    gc.collect(1)  # the young generations: what the last phase left in cycles (a full pass costs ~0.3 s)
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _reset_hwm() -> bool:
    """Reset this process's peak resident set to the current one; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmHWM") is not None
    except OSError:
        return False


class PeakMemory:
    """Peak memory of the code in a ``with`` block (see the module docstring).

    After the block: ``peak_bytes`` (the process's peak resident set, or CUDA
    memory allocated), ``extra_bytes`` (peak minus the start) and ``method``.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.peak_bytes = self.extra_bytes = 0
        self.method = ""

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            self.method = "torch.cuda.max_memory_allocated"
            return self
        release_free_memory()
        if _reset_hwm():
            self.start = _status_kib("VmRSS") * 1024
            self.method = "VmHWM (peak RSS, reset per phase via /proc/self/clear_refs, after malloc_trim)"
        else:
            self.start = 0
            self.method = "ru_maxrss since process start (upper bound)"
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        elif self.start:
            self.peak_bytes = _status_kib("VmHWM") * 1024
        else:
            self.peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.extra_bytes = max(0, self.peak_bytes - self.start)

    def as_dict(self, prefix: str = "") -> dict:
        return {f"{prefix}peak_rss_bytes" if self.device.type == "cpu" else f"{prefix}peak_bytes": self.peak_bytes,
                f"{prefix}peak_extra_bytes": self.extra_bytes}


# keep_freed_memory's glibc thresholds. Both must fit a C int: ctypes masks a larger Python int without
# a word (a trim threshold of 1 << 34 was passed as 0, which returns freed memory to the kernel at once).
MMAP_THRESHOLD = 1 << 30  # allocations below it come from the heap
TRIM_THRESHOLD = (1 << 31) - 1  # free memory kept at the heap's top before it is returned


def keep_freed_memory() -> bool:
    """Tune glibc's allocator for training on the CPU; returns False where it is not glibc.

    By default glibc serves every allocation above 32 MiB with a fresh ``mmap``
    and unmaps it on free, so each large activation of a long context pays
    its page faults again on every step (at 64k tokens this more than doubled
    the step time here). Raising the mmap and trim thresholds keeps freed
    memory in the heap for reuse, as a caching allocator does. It changes
    speed only, not results or peak memory (:class:`PeakMemory` trims first).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int  # int mallopt(int, int)
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt parameters from <malloc.h>
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD) and mallopt(m_trim_threshold, TRIM_THRESHOLD))


ONEDNN_CACHE_VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_CAPACITY = 64  # primitives oneDNN keeps (its own default: 1,024)


def bound_onednn_cache(capacity: int = ONEDNN_CACHE_CAPACITY) -> bool:
    """Cap oneDNN's primitive cache at ``capacity`` for this process, unless the user set its size;
    returns whether it set it.

    PyTorch runs the CPU GELU through oneDNN, which JIT-compiles a primitive per input shape and caches
    up to 1,024 of them (~28 KiB each here). The sheaf model's experts see as many rows as a site has
    nodes of a type, a new shape at almost every training step: the entries pile up between the step's
    large tensors and keep glibc's heap from reusing their space (``benchmarks/bench_train_memory.py``:
    at context 1k the resident set grew ~9 MiB per step, its live memory flat), and a miss with the
    full cache is slow. A cache of 64 still holds every shape of a repeated site. oneDNN reads the
    variable once, at its first primitive: set later, it changes nothing.
    """
    if ONEDNN_CACHE_VARIABLE in os.environ:
        return False
    os.environ[ONEDNN_CACHE_VARIABLE] = str(capacity)
    return True


HUGE_PAGES_VARIABLE = "THP_MEM_ALLOC_ENABLE"  # set by ``import sheafgnn`` unless the user set it


def huge_pages_on() -> bool:
    """Whether PyTorch's CPU allocator advises transparent huge pages for large tensors in this process.

    With ``THP_MEM_ALLOC_ENABLE=1``, PyTorch aligns each CPU tensor of 2 MiB or more to a page and marks it
    ``MADV_HUGEPAGE``. The sheaf model's training steps allocate tensors of a new size at almost every
    step (a site's node and edge counts vary by window), and in glibc's heap their freed space was reused
    badly: at context 1k the resident set grew to 1,336 MiB in 60 steps while live tensors peaked near
    310 MiB; with huge pages advised it stayed at 973 MiB, at the same step time
    (``benchmarks/bench_train_memory.py``). PyTorch reads the variable once, at its first CPU allocation
    (importing torch_geometric makes one), so ``import sheafgnn`` sets it before anything else; where the
    process allocated before that, or the user set it to ``0``, it is off. Checked on two tensors whose
    addresses are page-aligned only when it is on.
    """
    page = os.sysconf("SC_PAGESIZE")
    return all(torch.empty(n, dtype=torch.uint8).data_ptr() % page == 0 for n in (3 << 20, (5 << 20) + 64))


def tune_cpu() -> dict:
    """Both process-wide settings for training on the CPU: glibc's thresholds (:func:`keep_freed_memory`)
    and oneDNN's primitive cache (:func:`bound_onednn_cache`); returns which took, and whether large tensors
    are on huge pages (:func:`huge_pages_on`, set at import). An explicit call (the ``sheafgnn`` command, the
    training loop, the benchmarks): building a model changes no process setting."""
    return {"glibc": keep_freed_memory(), "onednn_cache": bound_onednn_cache(), "huge_pages": huge_pages_on()}


def process_peak_bytes(device: torch.device) -> int:
    """Peak bytes since the process started (or CUDA's last reset): memory allocated on a CUDA
    ``device``, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class _MallInfo2(ctypes.Structure):  # struct mallinfo2 of <malloc.h> (glibc >= 2.33), all size_t
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_stats() -> dict | None:
    """glibc's view of the C heap (``mallinfo2``): ``heap_bytes`` (the main heap's size), ``in_use_bytes``
    (allocated from it), ``free_bytes`` (free inside it: fragmentation when it grows while the live memory
    does not) and ``mmap_bytes`` (allocations served by their own mmap); None where it is not glibc >= 2.33."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"heap_bytes": info.arena, "in_use_bytes": info.uordblks, "free_bytes": info.fordblks,
            "mmap_bytes": info.hblkhd}


def resident_bytes() -> int | None:
    """This process's resident set now (``VmRSS``), None where ``/proc`` does not tell."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def take_peak_resident_bytes() -> int | None:
    """This process's peak resident set since the last call (or its start), and a new interval begun: ``VmHWM``,
    then the mark reset to the resident set now (:class:`PeakMemory`'s reset, without its trim, so the process
    runs on as it would). None where the kernel does not allow the reset: the mark would then be the process's
    peak so far, not the interval's."""
    kib = _status_kib("VmHWM")
    return None if kib is None or not _reset_hwm() else kib * 1024
