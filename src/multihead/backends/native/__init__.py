"""The native tile kernel: C++ against ATen, built for this CPU on first use; and when it runs.

>>> from multihead.backends import native
>>> isinstance(native.status(), str)
True

The torch tiles (:mod:`multihead.backends.tiles`) are the readable algorithm and the oracle; this
package is the same online softmax in C++ (``attention.cpp``, its backward ``backward.cpp``, what
they share ``common.h``, the row pieces of both forwards ``rows.h``): bfloat16/float16 operands into
float32 scores through ATen's ``at::native::cpublas::brgemm`` (AMX or AVX512-BF16 where the CPU
has them), the exponentials and row sums with ATen's ``Vectorized<float>``, the work shared by
``at::parallel_for`` over (batch, query head, query block), every output row computed by one
thread in a fixed order (the same bits at every thread count). Where the CPU has AMX, a bfloat16
forward runs ``amx_forward.cpp`` instead (:data:`AMX`, :func:`amx_tiles`): the products written
against the tile registers, 16 query rows x 64 keys of scores kept in L1, the tiles multiplying
while the vector units take the softmax. The backward recomputes the tiles
in two passes, one owning each key block's dK and dV, one each query block's dQ, so that every
sum has one owner and a fixed order (no atomics; the same bits at every thread count); it forms
the gradients of bias tensors too, but for one broadcast over both the queries and the keys
(the torch tiles form it). It reads the mask as
:attr:`Tiles.native_plan <multihead.backends.tiles.Tiles.native_plan>` gives it: the
structural parts' per-row key intervals, key padding, bias tensors, ALiBi and softcap; anything
else (a Python ``mask_mod`` or ``score_mod``, a dense keep tensor, float64) runs the torch tiles.

Build: :func:`module` compiles ``attention.cpp``, ``amx_forward.cpp`` and ``backward.cpp`` with ``torch.utils.cpp_extension`` (ninja and the
machine's C++ compiler, ``-O3 -march=native -fopenmp``: ATen's ``at::parallel_for`` is serial in
code built without OpenMP) into a cache directory named after the sources'
hash, the torch version, the compile flags and the CPU's feature flags, so a kernel built for
another CPU or torch is never loaded (another CPU gets a directory of its own and a build). A
build is made in a fresh temporary directory and renamed into place only when complete, so an
interrupted build is never loaded. ``MULTIHEAD_KERNEL_CACHE`` sets the cache root (default
``~/.cache/multihead/kernels``); ``python -m multihead.backends.native`` prebuilds (``make kernels``).

When it runs (:func:`why_not`): :data:`ENABLED` (or ``MULTIHEAD_NATIVE=0/1``) is not False, the CPU
is x86-64, and the build succeeded. Without a compiler or ninja, or when the build fails, the
torch tiles run and a warning says so once, naming the cause and the fix.

Sanitizers: with ``MULTIHEAD_NATIVE_SANITIZE=1`` the kernel is built with AddressSanitizer and
UndefinedBehaviorSanitizer (its own cache directory); the process must preload libasan
(``make sanitize`` does).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["ENABLED", "AMX", "CALLS", "module", "status", "why_not", "cpu_flags", "half_products", "amx_tiles",
           "amx_forward_why_not"]

#: passes the native kernel ran (under "forward" and "backward"; "forward on AMX tiles" counts the forwards
#: amx_forward.cpp ran); chunked's trace reads which kernel ran
CALLS: Counter[str] = Counter()

#: use the native kernel where it can run: None (default) reads ``MULTIHEAD_NATIVE`` (unset: yes),
#: True or False override it (the tests flip it to run both implementations)
ENABLED: Optional[bool] = None

#: run the bfloat16 forward on AMX tiles where the CPU has them and the shapes fit (head dims of 32k
#: and 16k, blocks of 16 x 64): None (default) reads ``MULTIHEAD_NATIVE_AMX`` (unset: yes), True or
#: False override it (the tests flip it to hold both forwards to the rule); False runs the brgemm
#: forward everywhere
AMX: Optional[bool] = None

#: the kernel's sources: the forward (and the module's bindings), the backward, what they share
_SOURCES = tuple(Path(__file__).with_name(n) for n in ("attention.cpp", "amx_forward.cpp", "backward.cpp", "common.h",
                                                         "rows.h", "amx_forward.h"))
#: /proc/cpuinfo flags that the compiled code may use (-march=native) or whose presence changes it
_VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                 "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16", "avx_vnni")


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _capability_define() -> list[str]:
    """ATen's vector width for the kernel's ``Vectorized<float>``: AVX512 or AVX2 where the CPU has it."""
    f = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f:
        return ["-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma"} <= f:
        return ["-DCPU_CAPABILITY_AVX2"]
    return []


def _sanitize() -> bool:
    return os.environ.get("MULTIHEAD_NATIVE_SANITIZE", "") not in ("", "0")


def _cflags() -> list[str]:
    # -fopenmp: ATen's at::parallel_for is a header template that runs its body serially unless the
    # including code is compiled with OpenMP (the libgomp it links is the one torch loaded)
    flags = ["-O3", "-march=native", "-std=c++17", "-fopenmp", *_capability_define()]
    if _sanitize():
        flags = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                 "-fno-sanitize-recover=undefined", "-march=native", "-std=c++17", "-fopenmp", *_capability_define()]
    return flags


def _key() -> str:
    h = hashlib.sha256()
    for source in _SOURCES:
        h.update(source.read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(_cflags()).encode())
    h.update(" ".join(sorted(cpu_flags() & set(_VECTOR_FLAGS))).encode())
    h.update(platform.machine().encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:20]


def cache_root() -> Path:
    """Where built kernels are kept: ``MULTIHEAD_KERNEL_CACHE`` or ``~/.cache/multihead/kernels``."""
    env = os.environ.get("MULTIHEAD_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "multihead" / "kernels"


def _import(path: Path, name: str) -> Any:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _ninja_on_path() -> Optional[str]:
    """A directory holding ninja, to put first on PATH for the build (the ninja package's, or the
    running Python's bin, where pip puts it), or None when ninja is already on PATH."""
    if shutil.which("ninja"):
        return None
    try:
        import ninja

        return str(ninja.BIN_DIR)
    except ImportError:
        here = Path(sys.executable).parent
        return str(here) if (here / "ninja").exists() else None


def _build(final: Path, name: str) -> Any:
    from torch.utils import cpp_extension

    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".building.", dir=root))
    extra = _ninja_on_path()
    path_before = os.environ.get("PATH", "")
    if extra:
        os.environ["PATH"] = extra + os.pathsep + path_before
    try:
        ldflags = ["-fopenmp", *(["-fsanitize=address,undefined"] if _sanitize() else [])]
        mod = cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES if s.suffix == ".cpp"], build_directory=str(tmp),
                                 extra_cflags=_cflags(), extra_ldflags=ldflags, verbose=False)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if extra:
            os.environ["PATH"] = path_before
    (tmp / "complete").write_text(name + "\n")
    try:
        os.rename(tmp, final)  # atomic: a directory named after the key is always complete
    except OSError:  # another process finished first: keep its build
        shutil.rmtree(tmp, ignore_errors=True)
    return mod


_FAILED: Optional[str] = None


def module() -> Any:
    """The built kernel module (built on first use, then from the cache), or None where it cannot
    be built here; :func:`status` says why."""
    return _module()


@functools.lru_cache(maxsize=None)
def _module() -> Any:
    global _FAILED
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _FAILED = f"the native kernel is built for x86-64 CPUs only (this is {platform.machine()})"
        return None
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        _FAILED = (f"no C++ compiler ({compiler!r} is not on PATH); install one (e.g. apt-get install g++) "
                   "or set CXX, then run `make kernels`")
        return None
    if shutil.which("ninja") is None and _ninja_on_path() is None:
        _FAILED = "ninja is missing; pip install ninja (the test extra has it), then run `make kernels`"
        return None
    key = _key()
    name = f"multihead_native_{key}"
    final = cache_root() / key
    try:
        if (final / "complete").exists() and (final / f"{name}.so").exists():
            return _import(final / f"{name}.so", name)
        return _build(final, name)
    except Exception as e:  # a failed build (or load) falls back to the torch tiles
        first = str(e).strip().splitlines()
        _FAILED = (f"building the native kernel failed ({type(e).__name__}: {first[-1] if first else ''}); "
                   f"see the log with `python -m multihead.backends.native`, or set MULTIHEAD_NATIVE=0")
        return None


_WARNED = False


def _warn_once() -> None:
    global _WARNED
    if not _WARNED and _FAILED is not None:
        _WARNED = True
        warnings.warn(f"multihead: the chunked backend runs the torch tiles: {_FAILED}", RuntimeWarning, stacklevel=4)


def enabled() -> bool:
    """Whether the native kernel is wanted (:data:`ENABLED`, else ``MULTIHEAD_NATIVE``, default yes)."""
    if ENABLED is not None:
        return ENABLED
    return os.environ.get("MULTIHEAD_NATIVE", "1") not in ("0", "", "false", "no")


def status() -> str:
    """One line: whether the native kernel is in use here, and why not."""
    if not enabled():
        return "native kernel off (multihead.backends.native.ENABLED / MULTIHEAD_NATIVE=0)"
    if module() is None:
        return f"native kernel unavailable: {_FAILED}"
    return f"native kernel ({_products_line()})"


def _products_line() -> str:
    bf16 = "bfloat16 operands" if half_products(torch.bfloat16) else "bfloat16 widened to float32 operands"
    amx = ("; the bfloat16 forward on AMX tiles, scores kept in L1 (head dims of 32k and 16k)" if amx_tiles()
           else "")
    return (f"brgemm products into float32: {bf16}{amx}; "
            f"CPU {', '.join(sorted(cpu_flags() & set(_VECTOR_FLAGS))) or 'baseline'}")


def amx_forward_why_not(dtype: torch.dtype, head_dim: int, value_dim: int,
                        blocks: Optional[tuple[int, int]] = None) -> Optional[str]:
    """Why the native forward of a call with these inputs, head dims and (queries, keys) blocks
    (None: not judged) does not run on AMX tiles here (None: it does, see :func:`amx_tiles`)."""
    if dtype != torch.bfloat16:
        return f"the AMX forward takes bfloat16 ({str(dtype).replace('torch.', '')} inputs)"
    if not amx_tiles():
        wanted = AMX if AMX is not None else os.environ.get("MULTIHEAD_NATIVE_AMX", "1") not in ("0", "", "false", "no")
        return ("switched off (multihead.backends.native.AMX or MULTIHEAD_NATIVE_AMX=0)" if not wanted
                else "this CPU or build has no AMX tiles")
    if head_dim % 32 or value_dim % 16:
        return f"head dims {head_dim} and {value_dim}: the AMX forward takes multiples of 32 and 16"
    if blocks is not None and (blocks[0] % 16 or blocks[1] % 64):
        return f"blocks of {blocks[0]} x {blocks[1]}: the AMX forward takes multiples of 16 x 64"
    return None


def amx_tiles() -> bool:
    """Whether bfloat16 forwards run on AMX tiles here (``amx_forward.cpp``): :data:`AMX` (else
    ``MULTIHEAD_NATIVE_AMX``, default yes) allows it, the kernel was built with AMX (``-march=native``
    on a CPU that has it) and the OS grants the tiles; the call's head dims must fit too (D a multiple
    of 32, Dv of 16)."""
    wanted = AMX if AMX is not None else os.environ.get("MULTIHEAD_NATIVE_AMX", "1") not in ("0", "", "false", "no")
    mod = module() if enabled() else None
    return bool(wanted and mod is not None and half_products(torch.bfloat16) and mod.amx_forward_available())


@functools.lru_cache(maxsize=None)
def half_products(dtype: torch.dtype) -> bool:
    """Whether bfloat16/float16 inputs' products take half operands (the CPU packs them for
    brgemm: AMX, AVX512-BF16) rather than float32 ones (exact too: a half number is a float32)."""
    mod = module()
    if mod is None or dtype not in (torch.bfloat16, torch.float16):
        return False
    return bool(mod.could_pack("bfloat16" if dtype == torch.bfloat16 else "float16"))


def why_not(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why the native kernel cannot run a call on ``device`` with inputs of ``dtype`` (None: it can);
    what a mask or a score mod asks for is judged by the tiles (``Tiles.native_plan``)."""
    if not enabled():
        return "the native kernel is switched off (multihead.backends.native.ENABLED or MULTIHEAD_NATIVE=0)"
    if device.type != "cpu":
        return f"it runs on the CPU (inputs on {device.type})"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"it takes float32, bfloat16 or float16 (got {str(dtype).replace('torch.', '')})"
    if module() is None:
        _warn_once()
        return f"it is unavailable: {_FAILED}"
    return None
