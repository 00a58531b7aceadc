"""The ranks' agreement before a context-parallel call: every rank describes its call, one small
all_gather compares the descriptions, and every rank raises the same ValueError naming the
ranks, the field and the fix if they differ (see the descriptor's table below).

Mismatched shards would otherwise abort a process inside the transport or give wrong results
silently. `ring_attention` checks before its forward and again before its backward ring; the
all-to-all (Ulysses) calls check the same way.
"""

from __future__ import annotations

import struct
import zlib
from typing import Optional

import torch

from .. import masks as _masks
from .layouts import LAYOUTS, DocumentLayout
from .transport import RingError, _check_timeout, _Ring

__all__ = ["mask_signature"]

# Before the ring runs (forward, and again before the backward ring), every rank sends the
# others a descriptor of its call, one all_gather of a fixed-size int64 tensor, which cannot
# fail on mismatched sizes the way the ring's sends do. If any field differs, every rank raises
# the same ValueError. Without the check, shards of different lengths or byte sizes abort a
# process inside gloo (SIGABRT) and leave its peers with garbage, and dtypes of one byte size
# (float16 vs bfloat16) or a different causal flag give wrong results on every rank, silently.
#
# The descriptor, one int64 per field of _FIELDS, in that order:
#   0 format     _FORMAT ("RING" and the format version), or _REJECTED from a rank whose own
#                argument checks failed (it raises its own error; the others raise this one)
#   1 pass       0 forward, 1 backward (a rank in backward must not meet one in forward)
#   2-7          B, H, Hkv, Lk, D, Dv of q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv)
#   8 dtype      index in _DTYPES
#   9 device     the device type's name (e.g. "cpu", "cuda"), ASCII, first 8 bytes, little-endian
#  10 padding    bit 0: a key padding tensor travels with the keys; bit 1: document ids do
#  11 causal     1 or 0
#  12 layout     index in LAYOUTS (a DocumentLayout's code) with causal masking or a kind placed
#                by position, -1 without (the layout is then unused)
#  13 scale      the float64 bits of the scale, as an int64 (compared bit for bit)
#  14 autograd   1 if this call records the graph for backward (grad mode on and q, k or v
#                requires grad), else 0; always 1 in the backward pass
# Lq is not compared: queries never travel, so without causal masking the ranks may hold
# different numbers of them (with it, Lq == Lk on every rank). Lk is compared unless every rank's
# layout is contiguous or unused: contiguous shards may be uneven, and the table gives each
# rank's length (its global start is the sum of the lengths before it).
_FORMAT = 0x52494E47_0001
_REJECTED = -_FORMAT
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_PASSES = ("forward", "backward")


def _pack_name(name: str) -> int:
    return int.from_bytes(name.encode("ascii", "replace")[:8], "little")


def _unpack_name(code: int) -> str:
    return code.to_bytes(8, "little").rstrip(b"\0").decode("ascii", "replace")


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(code: int) -> float:
    return struct.unpack("<d", struct.pack("<q", code))[0]


_SAME_MODEL = "every rank must run the same attention (the same model and head split)"
#: (what the value is, how to show it, how to fix a disagreement), one per descriptor field
_FIELDS = (
    ("descriptor", hex, "every rank must run the same version of multihead and call ring_attention (and its backward) at the same point of the program"),
    ("pass", lambda c: _PASSES[c], "backward runs its own ring: every rank must call backward on its share of the output (the same loss), in the same order, before its next ring_attention call"),
    ("batch size B", str, "every rank must hold the same batch; shard the sequence axis, not the batch"),
    ("query heads H", str, _SAME_MODEL),
    ("key/value heads Hkv", str, _SAME_MODEL),
    ("key/value shard length Lk", str, "zigzag and DocumentLayout shards must have the same length on every rank: cut them with shard_sequence, padding the sequence to a multiple of 2P and masking the padding with masks.key_padding (contiguous shards may be uneven)"),
    ("head dim D", str, _SAME_MODEL),
    ("value head dim Dv", str, _SAME_MODEL),
    ("dtype", lambda c: str(_DTYPES[c]), "cast q, k and v to one dtype on every rank, e.g. .to(torch.bfloat16)"),
    ("device type", _unpack_name, "put every rank's q, k and v on the same kind of device (each rank its own GPU, or all on CPU)"),
    ("key padding", lambda c: ("no", "yes")[c & 1] + (" (and document ids)" if c & 2 else ""),
     "pass mask=masks.key_padding(keep) on every rank or on none (keep all True on a shard without padding), "
     "and masks.documents(ids) likewise"),
    ("causal", lambda c: str(bool(c)), "pass the same causal= on every rank (mask=masks.causal() counts as causal=True)"),
    ("layout", lambda c: "unused (not causal)" if c < 0 else repr(LAYOUTS[c]) if c < len(LAYOUTS) else f"DocumentLayout #{c:x}",
     "pass the layout the shards were cut with, the same on every rank (a DocumentLayout of the same lengths)"),
    ("scale", lambda c: repr(_bits_float(c)), "pass the same scale= on every rank (None gives 1/sqrt(D))"),
    ("autograd", lambda c: ("does not record the graph", "records the graph")[c], "backward is a ring too, so every rank or none must record the graph: run every rank in the same grad mode, with the same inputs requiring grad"),
)
_PASS, _LK, _CAUSAL, _LAYOUT = 1, 5, 11, 12

def _describe(spec, q, k, v, keep, phase: str, records_graph: bool) -> list[int]:
    """This call's descriptor (see the table above); ``spec``: the ring's call spec (`ring._Spec`:
    its causal flag, layout, scale, document ids and kinds)."""
    B, H, _, D = q.shape
    return [
        _FORMAT, _PASSES.index(phase), B, H, k.shape[1], k.shape[2], D, v.shape[-1],
        _DTYPES.index(q.dtype), _pack_name(q.device.type), int(keep is not None) | (2 if spec.ids is not None else 0),
        spec.causal,
        (spec.layout.code() if isinstance(spec.layout, DocumentLayout) else LAYOUTS.index(spec.layout))
        if spec.causal or spec.kinds else -1, _float_bits(spec.scale), records_graph,
    ]


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _agree(ring: _Ring, descriptor: list[int]) -> Optional[list[list[int]]]:
    """Raise the same ValueError on every rank of the ring unless they all sent ``descriptor``'s
    values; the table of every rank's descriptor when they agree (None for one rank)."""
    if ring.size == 1:
        return None
    phase = _PASSES[descriptor[_PASS]]
    table = ring.all_gather(descriptor, what=f"the check that the ranks agree (before the {phase} ring)")
    if descriptor[0] == _REJECTED:
        return None  # this rank raises its own error
    head = f"ring_attention, rank {ring.rank} of {ring.size}: "
    rejected = [r for r, row in enumerate(table) if row[0] == _REJECTED]
    if rejected:
        raise ValueError(
            f"{head}{_ranks(rejected)} rejected its arguments, so the ring ran on no rank; "
            f"the error on {_ranks(rejected)} says what to fix there"
        )
    columns = list(zip(*table))
    differ = [i for i, column in enumerate(columns) if len(set(column)) > 1]
    if set(columns[_LAYOUT]) <= {-1, LAYOUTS.index("contiguous")} and _LK in differ:
        differ.remove(_LK)  # contiguous shards may be uneven
    if not differ:
        return table
    for first in (0, _PASS):  # another descriptor format, or forward meeting backward: the rest is noise
        if first in differ:
            differ = [first]
    if _CAUSAL in differ and _LAYOUT in differ:
        differ.remove(_LAYOUT)
    lines: list[str] = []
    odd: set[int] = set()
    for i in differ:
        column = columns[i]
        by_value: dict[int, list[int]] = {}
        for r, value in enumerate(column):
            by_value.setdefault(value, []).append(r)
        common = max(by_value, key=lambda value: (len(by_value[value]), -by_value[value][0]))
        others = [value for value in by_value if value != common]
        odd.update(r for value in others for r in by_value[value])
        name, show, fix = _FIELDS[i]
        has = "; ".join(f"{_ranks(by_value[value])} {'has' if len(by_value[value]) == 1 else 'have'} {show(value)}" for value in others + [common])
        lines.append(f"  {name}: {has}. Fix: {fix}.")
    raise ValueError(
        f"{head}the ranks disagree, so the ring did not run (it would abort a process or give wrong "
        f"results); {_ranks(sorted(odd))} differ{'s' if len(odd) == 1 else ''} from the others:\n" + "\n".join(lines)
    )


def _announce_rejection(group, timeout) -> None:
    """This rank's own argument checks failed: send the others a _REJECTED descriptor so that
    they raise too instead of waiting for it (best effort; the caller raises its own error)."""
    try:
        _check_timeout(timeout)
    except ValueError:
        timeout = None
    try:
        ring = _Ring(group, timeout)
    except Exception:  # noqa: BLE001 - no usable group (not initialised, not a member): nobody to tell
        return
    if ring.size > 1:
        try:
            ring.all_gather([_REJECTED] + [0] * (len(_FIELDS) - 1), what="telling the other ranks that this one rejected its arguments")
        except RingError:
            pass


def mask_signature(mask: Optional[_masks.Mask]) -> str:
    """The kinds and parameters of ``mask`` that every rank must share (the shards of key padding
    and document ids excepted): what the ranks compare before a ring or all-to-all call."""
    if mask is None:
        return "none"
    parts = []
    for p in mask.parts:
        if isinstance(p, (_masks.KeyPadding, _masks.Documents)):
            parts.append(p.kind)
            continue
        text = repr(p)
        for name in ("slopes", "logits"):
            t = getattr(p, name, None)
            if isinstance(t, torch.Tensor):
                text += f" {name}={zlib.crc32(t.detach().double().cpu().numpy().tobytes()):08x}"
        parts.append(text)
    return " & ".join(parts)


def _agree_on(ring: _Ring, name: str, mine: str, fix: str, *, head: str) -> None:
    """Every rank raises the same ValueError unless all sent the same ``mine`` (compared by crc32)."""
    if ring.size == 1:
        return
    table = [row[0] for row in ring.all_gather([zlib.crc32(mine.encode())], what=f"comparing {name}")]
    if len(set(table)) == 1:
        return
    groups: dict[int, list[int]] = {}
    for r, c in enumerate(table):
        groups.setdefault(c, []).append(r)
    shown = "; ".join(_ranks(rs) + " agree" for rs in groups.values())
    raise ValueError(f"{head}, rank {ring.rank} of {ring.size}: the ranks disagree on the {name} ({shown}; this "
                     f"rank has {mine}), so nothing ran. Fix: {fix}.")
