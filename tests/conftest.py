"""Shared pytest configuration.

Hypothesis profiles (select with ``pytest --hypothesis-profile=NAME``):

* ``default`` -- fast and reproducible for CI: derandomized (the same examples on every run),
  no example database, no deadline (CPU timing is noisy on shared machines).
* ``long`` -- a deeper search: 25x the examples, random (new examples each run), failures kept
  in the local ``.hypothesis`` database so they replay first next time.
"""

from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "default", max_examples=75, derandomize=True, database=None, deadline=None,
    suppress_health_check=_SLOW_OK, print_blob=True,
)
settings.register_profile(
    "long", max_examples=1000, derandomize=False, deadline=None,
    suppress_health_check=_SLOW_OK, print_blob=True,
)
settings.load_profile("default")

# The flex backend compiles a kernel per new graph (5-40 s each on the CPU); across the suites that
# run every backend it would take many minutes. There it runs torch's unfused FlexAttention (the same
# translation of the masks, not compiled); tests/test_flex.py runs the compiled path itself.
from multihead.backends import flex as _flex  # noqa: E402

_flex.COMPILE = False
