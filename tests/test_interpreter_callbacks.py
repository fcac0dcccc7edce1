"""The suite's faster interpreter callbacks (`interpreter_callbacks`) change no result.

The same kernels run on JAX's own callback path and on the NumPy one that
conftest installs: outputs bit for bit equal (NaN where NaN), and the race
detector reports the same kernel on both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import interpreter_callbacks
from jaxkv.kernels.mla_decode import MLADecodeConfig, mla_decode_plan
from mla_problem import BS, RACES, poison, problem
from mla_problem import run_decode as run_dense
from sparse_problem import FAST, inputs, poison_unselected
from sparse_problem import run_decode as run_sparse
from test_interpreter_races import _handoff


def both_paths(fn):
  """`fn()` on the NumPy path, then on JAX's own."""
  assert interpreter_callbacks.install(), (
      f"the NumPy path applies to jax {interpreter_callbacks.JAX_VERSION} alone: this is"
      f" {jax.__version__}; update `interpreter_callbacks` for it (or drop this test)")
  fast = fn()
  with interpreter_callbacks.jax_path():
    slow = fn()
  return fast, slow


def assert_same(fast, slow):
  for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(slow), strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_dense_decode_and_its_merge_are_the_same_on_both_paths():
  """Three splits through the merge kernel, the race detector on, "multiply"
  on a cache poisoned with NaN (rows 0 and 2 NaN, row 1 empty)."""
  seq_lens = [3 * BS + 5, 0, 2 * BS - 3]
  q, cache, table, lens = problem(7, seq_lens, 64)
  poisoned, _ = poison(cache, table, lens)
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=64,
                         config=MLADecodeConfig(num_splits=3, min_chunk_blocks=1))

  def run():
    return [run_dense(q, c, table, lens, splits=3, mask_mode=mode, interpret=RACES, plan=plan)
            for c, mode in ((cache, "select"), (poisoned, "multiply"))]

  fast, slow = both_paths(run)
  assert_same(fast, slow)
  assert np.isnan(np.asarray(fast[1][0][0], np.float32)).any()  # the poison reached "multiply"
  assert np.isfinite(np.asarray(fast[0][0], np.float32)).all()


def test_sparse_decode_is_the_same_on_both_paths():
  """Two splits merged in the kernel's clusters, clean and poisoned."""
  q, cache, idx = inputs(11, 2, 64, 128, invalid=0.2)
  poisoned = poison_unselected(cache, idx)

  def run():
    return [run_sparse(q, c, idx, mode, splits=2, interpret=FAST, cluster_merge=True)
            for c, mode in ((cache, "select"), (poisoned, "multiply"))]

  fast, slow = both_paths(run)
  assert_same(fast, slow)
  assert np.isnan(np.asarray(fast[1][0], np.float32)).any()


@pytest.mark.interpreter_races
@pytest.mark.parametrize("synchronised", [False, True])
def test_the_race_detector_sees_the_same_on_both_paths(interpreter_race_reports, synchronised):
  x = jnp.arange(128, dtype=jnp.float32)
  fast, slow = both_paths(lambda: _handoff(x, synchronised=synchronised))
  assert len(interpreter_race_reports) == 2
  raced = [bool(s.races_found) for s in interpreter_race_reports]
  assert raced == [not synchronised] * 2
  if synchronised:
    assert_same(fast, slow)
