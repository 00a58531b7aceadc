"""Shared pytest configuration.

Hypothesis profiles (select with ``pytest --hypothesis-profile=NAME``):

* ``default`` -- fast and reproducible for CI: derandomized (the same examples on every run),
  no example database, no deadline (CPU timing is noisy on shared machines).
* ``isa`` -- the ``default`` profile with a third of the examples, for the ISA passes of
  ``make test`` (the numerics-marked tests again under other CPU kernels): the main run has
  already searched the inputs; these passes look for a tolerance that holds on one CPU's rounding
  only, which any of the examples shows.
* ``long`` -- a deeper search: 25x the examples, random (new examples each run), failures kept
  in the local ``.hypothesis`` database so they replay first next time.

Markers (declared in pyproject.toml) are given here by rule, so that a test file need not carry
them (a test may also carry one itself):

* the slow families, left out by ``make test-fast``: ``compile`` (the test's own code calls
  ``torch.compile``), ``multiprocess`` (the ring files, which start worker processes),
  ``real_model`` (its name, parameters, fixtures or code name SmolLM2 or MiniLM, whose weights
  come from the weights packages), ``browser``, ``notebook``;
* ``numerics``: the tests whose verdict can move with the CPU's kernels (:data:`NUMERICS`);
  ``make test``'s ISA passes rerun them, less the flex ones.

In parallel (pytest-xdist, ``make test`` runs ``-n auto --dist loadgroup``):

* each worker's torch takes its share of the cores as intra-op threads (cores // workers:
  :data:`WORKER_THREADS`); tests about threads set their own counts;
* tests that share an expensive fixture run on one worker, so it is built once: those of a test
  module that use a module-scoped fixture of that module (a ring of worker processes, a browser,
  a notebook kernel, a mypy run, a model) form one group, and every test that loads SmolLM2
  (``multihead.explain.models`` keeps it per process) one group across files.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "default", max_examples=75, derandomize=True, database=None, deadline=None,
    suppress_health_check=_SLOW_OK, print_blob=True,
)
settings.register_profile("isa", settings.get_profile("default"), max_examples=25)
settings.register_profile(
    "long", max_examples=1000, derandomize=False, deadline=None,
    suppress_health_check=_SLOW_OK, print_blob=True,
)
settings.load_profile("default")

# The flex backend compiles a kernel per new graph (5-40 s each on the CPU); across the suites that
# run every backend it would take many minutes. There it runs torch's unfused FlexAttention (the same
# translation of the masks, not compiled); tests/backends/test_flex.py runs the compiled path itself.
from multihead.backends import flex as _flex  # noqa: E402

_flex.COMPILE = False


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


#: torch's intra-op threads in each xdist worker: its share of the cores, so that two workers on
#: two cores do not run four threads (measured here: `make test-fast` took as many CPU-seconds at
#: 2 threads per worker as the whole suite at 1). Tests about threads set their own counts.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in each xdist worker
WORKER_THREADS = max(1, _cores() // max(1, _WORKERS))
if _WORKERS > 1 and torch.get_num_threads() > WORKER_THREADS:
    torch.set_num_threads(WORKER_THREADS)


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    """Each test module starts with torch.compile's caches empty. torch's flex_attention compiles
    internally even when called eagerly, and a guard of an earlier module's call that reads an
    object since freed makes torch 2.13's recompilation-reason helper raise TypeError ('NoneType'
    object is not subscriptable) on the next recompile: under xdist, which modules share a worker
    changes with the suite, and so did whether it struck."""
    torch._dynamo.reset()
    yield


@pytest.fixture(scope="session")
def smollm2_model():
    """SmolLM2-135M-Instruct as ``multihead.explain.models.load("smollm2")`` gives it (float32,
    its attention on multihead): one load per process, shared with every other load of it there,
    and, since the tests that ask for it join the ``smollm2`` group, one load per run under
    xdist. Skips, saying what to install, when the weights package or gguf is missing."""
    from multihead.explain import models

    try:
        return models.load("smollm2")
    except ImportError as e:
        pytest.skip(str(e))


#: This folder: the tables below name test files by their path relative to it ("api/test_contexts.py").
TESTS = Path(__file__).resolve().parent

#: test files each of whose tests belongs to a slow family
FAMILY_OF_FILE = {
    "distributed/test_distributed.py": "multiprocess",
    "distributed/test_ring_agreement.py": "multiprocess",
    "explain/test_browser.py": "browser",
    "explain/test_notebook.py": "notebook",
}
#: The ``numerics`` tests, what `make test`'s ISA passes rerun: those whose verdict can move with
#: the CPU's kernels (SIMD width, oneDNN and MKL code paths), by test file (its path under tests/): None for every test of
#: the file, else the test functions. They compare a float32/bf16/fp16 result with the float64
#: oracle, the reference backend, SDPA, nn.MultiheadAttention or transformers' eager under a
#: derived tolerance, take a branch on such a value, or hold a result bit-identical across thread
#: counts. Left to the main run: float64 gradchecks, exact codec round trips, dispatch, refusals,
#: thread and memory bookkeeping. A new test joins with ``@pytest.mark.numerics``;
#: tests/project/test_testinfra.py checks that each name here is a test of its file.
NUMERICS = {
    "core/test_numerics.py": None,
    "backends/test_tiles.py": None,
    "backends/test_native.py": {"test_gradients_are_the_same_bits_at_every_thread_count",
                                "test_same_bits_at_every_thread_count"},
    "functional/test_properties.py": {
        "test_every_backend_matches_float64_oracle", "test_module_and_its_paths_match_float64_oracle",
        "test_module_weights_match_float64_oracle", "test_attention_weights_match_float64_oracle",
        "test_from_torch_matches_nn_multihead_attention",
    },
    "functional/test_functional.py": {
        "test_every_backend_matches_float64_oracle", "test_low_precision_error_within_twice_naive",
        "test_attention_weights_match_oracle_and_rows_sum_to_one", "test_sdpa_backend_matches_torch_sdpa",
        "test_fully_masked_rows_give_zero_output_and_finite_grads", "test_fully_masked_by_minus_inf_bias_gives_zero",
        "test_empty_sequences_give_defined_results", "test_bottom_right_with_more_queries_than_keys_leaves_first_rows_empty",
    },
    "backends/test_chunked.py": {
        "test_float32_error_within_twice_the_reference_backend", "test_matches_float64_oracle_with_small_tiles",
        "test_half_types_are_accumulated_in_float32", "test_gradients_match_reference_backend_at_larger_size",
        "test_chunked_forward_and_backward_under_cpu_autocast_bf16", "test_module_with_chunked_backend_trains_under_cpu_autocast",
        "test_module_with_chunked_backend_matches_reference", "test_scores_far_above_the_first_tiles_shift_are_redone_exactly",
        "test_chunked_shift_survives_alibi_with_left_padding", "test_chunked_shift_survives_empty_first_tile",
        "test_the_forward_runs_again_only_when_a_row_sum_passed_the_limit", "test_selected_heads_and_rows_match_the_full_weights",
        "test_rows_without_keys_give_zero_output_lse_minus_inf_and_zero_grads",
        "test_scores_are_kept_in_base_2_exactly_where_no_score_mod_reads_them",
        "test_chunked_is_bit_identical_from_run_to_run_at_every_thread_count",
    },
    "api/test_contexts.py": {
        "test_attention_in_every_context_matches_float64_oracle", "test_module_in_every_context_matches_float64_oracle",
        "test_cached_decoding_in_every_context_matches_float64_oracle", "test_compiled_module_with_inductor_matches_float64_oracle",
        "test_exported_module_matches_float64_oracle",
    },
    "integrations/test_hf.py": {
        "test_whole_model_on_multihead_matches_eager", "test_every_attention_op_of_the_model_meets_the_oracle_rule",
        "test_output_attentions_equal_eager", "test_sentence_embeddings_match_eager",
        "test_llama_model_on_multihead_matches_eager_with_and_without_padding",
        "test_from_hf_reproduces_every_bert_layer_on_a_padded_batch", "test_attention_forward_matches_eager_on_float_bool_and_biased_masks",
        "test_every_layer_runs_through_multihead",
    },
}
#: Of test_contexts' contexts, those whose numerics differ: the float32 path with autograd (grad)
#: and without (no_grad, the one cached decoding has), bf16 (autocast), and a thread count that
#: splits the work unevenly. inference_mode, deterministic and the other thread counts run the
#: same float32 paths.
NUMERICS_CONTEXTS = {"grad", "no_grad", "autocast_bf16", "threads_3"}
REAL_MODELS = ("smollm2", "minilm")


def _relative(item: pytest.Item) -> str:
    """The item's file as the tables name it: its path under tests/, with forward slashes."""
    try:
        return item.path.resolve().relative_to(TESTS).as_posix()
    except ValueError:  # a test file outside tests/ (pytest given another folder)
        return item.path.name


def _source(item: pytest.Item) -> str:
    try:
        return inspect.getsource(item.function)  # type: ignore[attr-defined]
    except (AttributeError, OSError, TypeError):
        return ""


def _numerics(item: pytest.Item, file: str) -> bool:
    if file not in NUMERICS:
        return False
    names = NUMERICS[file]
    if names is not None and getattr(item, "originalname", item.name) not in names:
        return False
    context = getattr(getattr(item, "callspec", None), "params", {}).get("context")
    return not isinstance(context, str) or file != "api/test_contexts.py" or context in NUMERICS_CONTEXTS


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--numerics-files", action="store_true",
                     help="collect only the test files that can hold numerics tests (those of NUMERICS and those that "
                          "write pytest.mark.numerics): what the ISA passes run, without importing the rest")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``--numerics-files``, leave out the test files that hold no numerics test."""
    if not config.getoption("numerics_files") or not collection_path.name.startswith("test_") \
            or collection_path.suffix != ".py":
        return None
    path = collection_path.resolve()
    if path.is_relative_to(TESTS) and path.relative_to(TESTS).as_posix() in NUMERICS:
        return None
    try:
        return None if "mark.numerics" in path.read_text(encoding="utf-8") else True
    except OSError:
        return None


def _module_fixtures(item: pytest.Item) -> list[str]:
    """The module- or session-scoped fixtures defined in the item's own test module that it uses."""
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(item, "module", None)
    if info is None or module is None:
        return []
    names = []
    for name, defs in info.name2fixturedefs.items():
        d = defs[-1]
        if d.scope in ("module", "session") and getattr(d.func, "__module__", None) == module.__name__:
            names.append(name)
    return names


@pytest.hookimpl(tryfirst=True)  # before xdist's, which names each test's group from its markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    grouping = config.pluginmanager.hasplugin("xdist")
    for item in items:
        file = _relative(item)
        source = _source(item)
        # the test's name with its parameters, and the fixtures it asks for
        named = " ".join([item.nodeid, str(getattr(getattr(item, "callspec", None), "params", "")),
                          *getattr(item, "fixturenames", ())]).lower()
        if file in FAMILY_OF_FILE:
            item.add_marker(FAMILY_OF_FILE[file])
        if "torch.compile(" in source:
            item.add_marker("compile")
        if any(model in named or model in source.lower() for model in REAL_MODELS):
            item.add_marker("real_model")
        if _numerics(item, file):
            item.add_marker("numerics")
        if grouping and item.get_closest_marker("xdist_group") is None:
            if "smollm2" in named:
                item.add_marker(pytest.mark.xdist_group("smollm2"))
            elif _module_fixtures(item):
                item.add_marker(pytest.mark.xdist_group(file))
