"""Test-wide settings: 24 fake CPU devices, one compilation cache for the run, strict
dtype promotion, jaxtyping checks, the GPU interpreter's callbacks on NumPy arguments."""

import os
import shutil
import tempfile

# Must be set before jax is imported anywhere in the test process. 24: the
# GPU interpreter runs every warpgroup of a cluster at once, 24 for sparse
# decode's clusters of 8 CTAs (`kernels._common.require_interpreter_threads`).
# LLVM's expensive passes off: most of an interpreted test is XLA's CPU compile
# of the programs the interpreter runs (a sparse and a dense test 52 -> 47 s);
# the results stay bit for bit the same (BUILD.md).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=24 --xla_llvm_disable_expensive_passes=true"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One compilation cache for the run, made by the controller (the xdist workers
# inherit its environment) and removed at its end: many tests compile the
# same interpreted programs (the same kernel body, another test's closure),
# and a hit skips XLA's compile (the suite 858 -> 738-791 s on 2 cores). Each
# run starts empty, as CI does. A cached executable's Python callbacks are
# bound again when it is loaded, so the interpreter's callbacks stay this
# process's own. Each worker keeps its entries in a folder of its own: JAX
# writes an entry in place, unlocked, so a worker reading an entry the other
# is still writing got a truncated file (and, warnings being errors, a failed
# collection: both workers import every test module at once).
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_CACHE = tempfile.mkdtemp(prefix="jaxkv-tests-")
else:  # a worker, or a cache of the caller's own (kept)
  _RUN_CACHE = None
if "PYTEST_XDIST_WORKER" in os.environ and "JAX_COMPILATION_CACHE_DIR" in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
      os.environ["JAX_COMPILATION_CACHE_DIR"], os.environ["PYTEST_XDIST_WORKER"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # every program

import re  # noqa: E402

import jaxtyping  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# jaxtyping's annotations come from these imports; a module without them has
# none to check.
_ANNOTATED = re.compile(r"^\s*(from|import)\s+(jaxtyping|jaxkv\._types|\.+_types)\b", re.M)


def _module_files():
  """(name, path) of every jaxkv module but the packages' `__init__`s."""
  for package, folder in (("jaxkv", "jaxkv"), ("jaxkv.kernels", "kernels")):
    top = os.path.join(_ROOT, folder)
    for dirpath, _, files in os.walk(top):
      rel = os.path.relpath(dirpath, top)
      prefix = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
      for name in files:
        if name.endswith(".py") and name != "__init__.py":
          yield f"{prefix}.{name[:-3]}", os.path.join(dirpath, name)


def all_modules() -> list[str]:
  return sorted(name for name, _ in _module_files())


def annotated_modules() -> list[str]:
  """The jaxkv modules whose signatures carry jaxtyping annotations (they
  import jaxtyping or `jaxkv._types`), by name; never a package, whose name
  would take in every module below it. The others (the launch plans' integer
  arithmetic, the configs, the kernel bodies) stay as written: the hook wraps
  every function of a module it loads, ~20x the cost of a call to the plans'
  small functions (`test_sparse_stream.py`: 0.8 s bare, 22 s wrapped), and a
  config's own checks, not beartype's, are what its tests must reach.
  `test_type_checks.py` holds every jaxtyping annotation to these modules."""
  names = []
  for name, path in _module_files():
    with open(path) as f:
      if _ANNOTATED.search(f.read()):
        names.append(name)
  return sorted(names)


# Runtime shape/dtype checks of every jaxtyping-annotated jaxkv signature.
jaxtyping.install_import_hook(annotated_modules(), "beartype.beartype")

import hypothesis  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

import devices  # noqa: E402
import interpreter_callbacks  # noqa: E402

# The GPU interpreter's callbacks without a `device_put` of each argument (a
# sparse decode test 108 -> 33 s, the suite 24 -> 14 minutes on 2 slow cores;
# `tests/test_interpreter_callbacks.py` checks that results are the same).
interpreter_callbacks.install()

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

hypothesis.settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True
)
hypothesis.settings.load_profile("ci")


@pytest.fixture(autouse=True)
def interpreter_race_reports(request, monkeypatch):
  """Fails a test whose interpreted kernels raced; resets the interpreter after it.

  The Pallas GPU interpreter's race detector (`InterpretGPUParams(
  detect_races=True)`) only prints what it finds and keeps a flag on a
  per-kernel state object, so a racing kernel would pass its test. Every
  such object made during the test is kept (the list is the fixture's value)
  and any that saw a race fails the test, unless the test is marked
  `interpreter_races` and checks them itself. (The detector sees loads,
  stores and copies, not the SMEM operands a `wgmma` reads: the order of a
  wgmma against stores to its operands is checked by values, e.g. NaN
  poisoning.) An exception inside an interpreted kernel also leaves global
  state behind: reset after each test.
  """
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

  states = []
  make = gpu_callbacks.GPURaceDetectionState

  def recorded(*args, **kwargs):
    state = make(*args, **kwargs)
    states.append(state)
    return state

  monkeypatch.setattr(gpu_callbacks, "GPURaceDetectionState", recorded)
  yield states
  gpu_callbacks.reset_gpu_interpret_mode_state()
  if request.node.get_closest_marker("interpreter_races") is None:
    raced = sum(bool(s.races_found) for s in states)
    assert not raced, (
        f"the Pallas GPU interpreter's race detector reported races in {raced} of"
        f" {len(states)} interpreted kernels (the details are in the captured stdout)"
    )


@pytest.fixture
def h100_pcie(monkeypatch):
  """Makes the kernels' first device (`kernels._common.first_device`) an H100
  PCIe (114 multiprocessors, no tuned configs), for the tests of plans sized
  by the device's multiprocessors. Calls still run where they ran: no GPU
  is faked present (`devices.as_first_device` fakes one)."""
  from jaxkv.kernels import _common

  device = devices.gpu("NVIDIA H100 PCIe", "9.0", core_count=114)
  monkeypatch.setattr(_common, "first_device", lambda: device)


# The files whose tests run interpreted kernels, slowest first: with `-n 2` the
# quick tests then come last and even out the two workers' ends, instead of one
# worker running a long kernel test alone while the other is idle.
_INTERPRETED_FIRST = (
    "test_sparse_schedules.py",
    "test_mla_decode.py",
    "test_sparse_mla_decode.py",
    "test_mla_decode_merge.py",
    "test_sparse_piece_merge.py",
    "test_sparse_f16_partials.py",
    "test_mla_decode_f16_partials.py",
    "test_nan_in_valid_data.py",
    "test_interpreter_callbacks.py",
)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(_INTERPRETED_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept


def pytest_unconfigure(config):
  if _RUN_CACHE is not None:  # the controller (or the only process) made it
    shutil.rmtree(_RUN_CACHE, ignore_errors=True)
