"""One launcher for the tests that run gloo process groups on this machine.

``spawn_ranks(worker, P, folder)`` runs ``worker(rank, store, out, *args)`` in P processes that meet
through a FileStore in ``folder`` (no port, so parallel test workers cannot collide); each rank
saves a dict of its results to ``f"{out}.{rank}"``, with the traceback under "error" when it failed.
The parent loads them and fails naming the rank and its traceback.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import torch
import torch.multiprocessing as mp

#: imported once by the fork server, not again by each rank: a rank is forked from it (milliseconds)
#: instead of starting a Python that imports torch (seconds of CPU per rank). The server starts
#: fresh (not forked from the test process). Never multihead: Python 3.11's fork server imports its
#: preload on the default sys.path, which may find another checkout's multihead (an editable
#: install); each rank imports multihead itself, on the test process's sys.path.
PRELOAD = ["torch", "torch.distributed"]


def spawn_ranks(worker, nprocs: int, folder: Path, *args) -> list[dict]:
    """Every rank's result dict, in rank order; AssertionError with a rank's traceback if it failed."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(worker, args=(str(folder / "store"), str(folder / "out"), *args), nprocs=nprocs, join=True,
                       start_method="forkserver")
    got = [torch.load(f"{folder / 'out'}.{r}") for r in range(nprocs)]
    for r, res in enumerate(got):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return got
