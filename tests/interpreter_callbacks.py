"""The Pallas GPU interpreter's callbacks given their arguments as NumPy arrays.

The interpreter runs every load, store, copy, barrier and wgmma of a kernel
as a `jax.experimental.io_callback` into host code that keeps SMEM and GMEM
as NumPy buffers. In jax 0.11.2, `io_callback`'s host side first turns each
of a call's flat arguments (a dozen scalars: the thread's mesh location, an
allocation key, the token) into a jax Array by `device_put`, and the
callback then reads them back as Python ints: that round trip was ~60% of
an interpreted kernel's time and most of the test suite's (a sparse decode
test: 108 s, 33 s with this).

`install()` hands the interpreter's own callbacks (those defined in its
`gpu_callbacks` module; any other `io_callback` keeps JAX's path) the NumPy
arrays XLA passes in, and lets the interpreter's scalar conversion
(`shared_memory._to_int`) take NumPy scalars. The callbacks compute with
NumPy on those buffers either way, so results are bit for bit the same:
`tests/test_interpreter_callbacks.py` compares kernels run both ways.

It patches private JAX modules, so it applies only to the version it was
written against (`JAX_VERSION`); under any other, `install()` changes
nothing and the suite runs on JAX's own path.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np

JAX_VERSION = "0.11.2"

_saved: dict[str, object] = {}


def _defined_in(flat_callback, module: str) -> bool:
  """Whether an `io_callback`'s function (under any `functools.partial`) is `module`'s."""
  fn = flat_callback.callback_func
  while isinstance(fn, functools.partial):
    fn = fn.func
  return getattr(fn, "__module__", None) == module


def install() -> bool:
  """Installs the NumPy path; returns whether it did (only under `JAX_VERSION`)."""
  if jax.__version__ != JAX_VERSION or _saved:
    return bool(_saved)
  from jax._src import callback as jax_callback
  from jax._src import config, tree_util
  from jax._src import xla_bridge as xb
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, shared_memory

  io_callback_impl = jax_callback.io_callback_impl
  to_int = shared_memory._to_int

  def numpy_io_callback_impl(*args, result_avals, callback, sharding, ordered):
    if not _defined_in(callback, gpu_callbacks.__name__):
      return io_callback_impl(*args, result_avals=result_avals, callback=callback,
                              sharding=sharding, ordered=ordered)
    # As JAX's own, less the `device_put` of every argument.
    cpu_device, *_ = xb.local_devices(backend="cpu")
    with config.default_device(cpu_device):
      return tree_util.tree_map(np.asarray, callback(*args))

  def numpy_to_int(x):
    if isinstance(x, (np.ndarray, np.generic)):
      return int(x)
    return to_int(x)

  _saved.update(io_callback_impl=io_callback_impl, to_int=to_int)
  jax_callback.io_callback_impl = numpy_io_callback_impl
  shared_memory._to_int = numpy_to_int
  return True


def uninstall() -> None:
  """Puts JAX's own functions back (nothing if `install` changed nothing)."""
  if not _saved:
    return
  from jax._src import callback as jax_callback
  from jax._src.pallas.mosaic_gpu.interpret import shared_memory

  jax_callback.io_callback_impl = _saved.pop("io_callback_impl")
  shared_memory._to_int = _saved.pop("to_int")


@contextlib.contextmanager
def jax_path():
  """Runs the body on JAX's own callback path, then restores what was installed."""
  was = bool(_saved)
  uninstall()
  try:
    yield
  finally:
    if was:
      install()
