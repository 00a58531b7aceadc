"""The CPU thread runtime of the tile kernel: how many threads share a call's query blocks, which
block each takes, and running them each single-threaded without touching any other thread.

>>> from multihead.backends import cpu_threads
>>> [cpu_threads.worker_of(b, 3) for b in range(8)]     # dealt back and forth
[0, 1, 2, 2, 1, 0, 0, 1]
>>> cpu_threads.share(lambda w: w * w, 1)               # one worker: the calling thread
[0]

On CPU the query blocks are shared among ``torch.get_num_threads()`` threads, dealt out back and
forth (0, 1, .., n-1, n-1, .., 0, ..: equal work under a causal mask), each running torch
single-threaded (one parallel region per thread, not one per op). A thread is made
single-threaded with the per-thread calls of OpenMP and MKL, not with ``torch.set_num_threads``,
which is process-wide (see :func:`_runtime_setters`); where that is not possible, or where a
Python dispatch mode or a tensor subclass is in play, everything runs in the calling thread.
``torch.set_num_threads(1)`` keeps every call in the calling thread.

This module knows nothing of attention: :mod:`multihead.backends.tiles` hands it work.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from typing import Callable, Optional, TypeVar

import torch

__all__ = ["worker_of", "workers_for", "share", "python_modes_active"]

T = TypeVar("T")
#: a ctypes function of one int (set the calling thread's thread count)
Setter = Callable[[int], int]


def worker_of(block: int, workers: int) -> int:
    """The worker of query block ``block``: blocks dealt out back and forth (0, 1, .., n-1,
    n-1, .., 0, 0, 1, ..), so that under a causal mask, whose block i has i + 1 tiles, every
    worker gets the same number of tiles (dealing round-robin gives the last worker the most)."""
    turn, place = divmod(block, workers)
    return place if turn % 2 == 0 else workers - 1 - place


def workers_for(blocks: int, *tensors: torch.Tensor) -> int:
    """How many threads share ``blocks`` query blocks: ``torch.get_num_threads()`` of them (at
    most one per block) on CPU when each thread can run torch
    single-threaded without touching the others (:func:`_one_thread_here`); otherwise 1, the
    calling thread. Also 1 where thread-local state would not reach other threads: tensor
    subclasses, and Python dispatch or function modes (e.g. FakeTensorMode, FlopCounterMode)."""
    threads = torch.get_num_threads()
    if threads < 2 or blocks < 2 or tensors[0].device.type != "cpu":
        return 1
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors) or python_modes_active():
        return 1
    return min(threads, blocks) if _thread_local_threads_work() else 1


def python_modes_active() -> bool:
    """Whether a Python dispatch or function mode is active (True when this torch cannot tell)."""
    try:
        return bool(torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack())
    except AttributeError:
        return True


def share(work: Callable[[int], T], n: int) -> list[T]:
    """``[work(w) for w in range(n)]``: in the calling thread for n = 1, else each in its own
    thread, running torch single-threaded, in the caller's inference mode and without autograd
    (the passes need none). The caller's torch.get_num_threads() and every other thread's are
    left alone."""
    if n == 1:
        return [work(0)]
    inference = torch.is_inference_mode_enabled()

    def run(w: int) -> T:
        _one_thread_here()
        with torch.inference_mode(inference), torch.no_grad():
            return work(w)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


@functools.lru_cache(maxsize=None)
def _runtime_setters() -> tuple[Optional[Setter], Optional[Setter]]:
    """The thread-local halves of ``torch.set_num_threads``, as ctypes functions of int, or None.

    torch.set_num_threads(n) is process-wide: besides the calling thread's OpenMP and MKL
    settings it stores n where every thread that starts later copies it from (ATen's
    ParallelOpenMP.cpp; torch 2.13 offers no per-thread variant), so a worker calling it would
    set the thread count of unrelated threads. OpenMP's ``omp_set_num_threads`` and MKL's
    ``MKL_Set_Num_Threads_Local`` set the calling thread's alone.
    """
    def find(name: str, libraries: list[Optional[str]]) -> Optional[Setter]:
        for lib in libraries:
            try:
                f = getattr(ctypes.CDLL(lib), name)
            except (OSError, TypeError, AttributeError):
                continue
            f.argtypes, f.restype = [ctypes.c_int], ctypes.c_int
            return f  # type: ignore[no-any-return]
        return None

    here = os.path.join(os.path.dirname(torch.__file__), "lib")
    files = sorted(os.listdir(here)) if os.path.isdir(here) else []

    def ours(*prefixes: str) -> list[Optional[str]]:  # torch's own copies first, then whatever the process has loaded
        return [os.path.join(here, f) for f in files if f.startswith(prefixes)] + [None]

    omp = find("omp_set_num_threads", ours("libgomp", "libiomp", "libomp", "libtorch_cpu.")) \
        if torch.backends.openmp.is_available() else None  # type: ignore[no-untyped-call]
    mkl = find("MKL_Set_Num_Threads_Local", ours("libtorch_cpu.", "torch_cpu.", "libmkl")) \
        if torch.backends.mkl.is_available() else None  # type: ignore[no-untyped-call]
    return omp, mkl


def _one_thread_here() -> bool:
    """Make torch's intra-op work single-threaded in the calling thread alone; whether it did."""
    omp, mkl = _runtime_setters()
    if omp is None or (mkl is None and torch.backends.mkl.is_available()):  # type: ignore[no-untyped-call]
        return False
    torch.get_num_threads()  # torch's own setup of a new thread first: it would undo ours later
    omp(1)
    if mkl is not None:
        mkl(1)
    return torch.get_num_threads() == 1  # it was the OpenMP runtime torch itself uses


@functools.lru_cache(maxsize=None)
def _thread_local_threads_work() -> bool:
    """Whether :func:`_one_thread_here` works in this process (tried once, in a thread of its own)."""
    result = []
    probe = threading.Thread(target=lambda: result.append(_one_thread_here()))
    probe.start()
    probe.join()
    return result == [True]
