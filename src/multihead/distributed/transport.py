"""The ring's transport: point-to-point sends round a process group and its collectives, each
wait bounded by a timeout and failing as a `RingError` that names the rank and the step.

Transport is torch.distributed point-to-point (``batch_isend_irecv``): gloo on CPUs, NCCL on
GPUs, processes launched with ``torchrun``.
"""

from __future__ import annotations

import datetime
import numbers
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["RingError"]


class RingError(RuntimeError):
    """A send or receive of the ring, or its agreement check, failed: a peer rank died, left, or
    did not answer in time."""


class _Pending:
    """Receives in flight; :meth:`wait` returns the received tensors."""

    def __init__(self, ring: "_Ring", works, sent, received, what: str, step: Optional[int]):
        self.ring, self.works, self.sent, self.received = ring, works, sent, received
        self.what, self.step = what, step

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            try:
                if self.ring.timeout is None:
                    w.wait()
                else:
                    w.wait(self.ring.timeout)
            except RuntimeError as e:
                raise self.ring.error(self.what, self.step, e) from e
        return self.received


class _Ring:
    """The ring over a process group: rank r sends to r+1 and receives from r-1 (group ranks)."""

    def __init__(self, group, timeout: Optional[float]):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ring_attention needs torch.distributed: call torch.distributed.init_process_group"
                "(backend='gloo' or 'nccl') first, e.g. in a script launched with torchrun"
            )
        chosen = dist.group.WORLD if group is None else group
        if chosen is None:  # initialised above, so the default group exists
            raise RuntimeError("torch.distributed has no default process group; pass group=")
        self.group = chosen
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the process group passed as group")
        self.size = dist.get_world_size(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        # for the agreement check: the device that all_gather_object uses on this group ("cpu"
        # for gloo, "cuda" for NCCL), the same on every rank whatever device its tensors are on
        pick = getattr(dist.distributed_c10d, "_get_object_coll_device", None)  # private in torch 2.13
        self.collective_device = pick(self.group) if pick else "cpu"

    def error(self, what: str, step: Optional[int], cause: Exception) -> RingError:
        """``step=None``: the agreement check before the ring, a collective over the group."""
        limit = "the process group's timeout" if self.timeout is None else f"timeout={self.timeout.total_seconds():g} s"
        if step is None:
            where = "failed (an all_gather over the group)"
        else:
            where = (
                f"at step {step + 1} of {self.size} failed (send to rank {(self.rank + 1) % self.size}, "
                f"receive from rank {(self.rank - 1) % self.size})"
            )
        return RingError(
            f"ring attention, rank {self.rank} of {self.size}: {what} {where}; "
            f"another rank probably failed, exited or hung (waits are bounded by {limit}): "
            f"check the other ranks' logs. Cause: {cause}"
        )

    def all_gather(self, values: list[int], *, what: str) -> list[list[int]]:
        """Every rank's ``values`` (equal-length int lists; list index = group rank), one collective."""
        mine = torch.tensor(values, dtype=torch.int64)
        return torch.stack(self.gather(mine, what=what)).tolist()

    def gather(self, tensor: torch.Tensor, *, what: str) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (one shape and dtype on every rank; list index = group rank), on
        the collective device, in one all_gather."""
        mine = tensor.to(self.collective_device).contiguous()
        if self.size == 1:
            return [mine]
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        try:
            work = dist.all_gather(gathered, mine, group=self.group, async_op=True)
        except RuntimeError as e:
            raise self.error(what, None, e) from e
        return _Pending(self, [work], [mine], gathered, what, None).wait()

    def shift(self, tensors, *, tag: int, what: str, step: int, length: Optional[int] = None) -> _Pending:
        """Send ``tensors`` to the next rank and receive same-shaped ones from the previous, asynchronously;
        ``length``: the received ones hold this many tokens on their sequence axis (dim -2 of 4-D
        tensors, -1 of (B, n) ones) instead of as many as the sent ones (uneven shards)."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) if length is None else t.new_empty(_with_length(t.shape, length)) for t in sent]
        ops = []
        for i, (s, r) in enumerate(zip(sent, received)):
            ops.append(dist.P2POp(dist.isend, s, self.next, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag + i))
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self.error(what, step, e) from e
        return _Pending(self, works, sent, received, what, step)


def _with_length(shape, length: int) -> list[int]:
    """``shape`` with its sequence axis (dim -2 of (B, H, n, D), -1 of (B, n)) set to ``length``."""
    out = list(shape)
    out[-2 if len(out) == 4 else -1] = length
    return out


def _check_timeout(timeout) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
