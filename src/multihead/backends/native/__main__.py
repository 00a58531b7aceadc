"""``python -m multihead.backends.native``: build the native kernel for this CPU now (``make kernels``),
say where it is cached, and exit 1 (saying why) where it cannot be built."""

from __future__ import annotations

import sys

from . import cache_root, module, status


def main() -> int:
    built = module() is not None
    print(status())
    print(f"cache: {cache_root()}")
    return 0 if built else 1


if __name__ == "__main__":
    sys.exit(main())
