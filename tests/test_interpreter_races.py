"""The suite's race check (conftest's `interpreter_race_reports`) on two small kernels.

One warpgroup writes a shared-memory buffer and the other copies it out,
with or without a barrier between them: the interpreter's race detector must
report the unsynchronised kernel, and only that one, to the fixture that
fails every other test whose kernels race.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

RACES = plgpu.InterpretGPUParams(detect_races=True)


def _handoff(x, *, synchronised: bool):
  def body(x_ref, o_ref, smem, bar):
    # x_ref, o_ref [128] f32, GMEM; smem [128] f32; bar: one arrival.
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
      smem[...] = x_ref[...] * 2.0
      if synchronised:
        plgpu.barrier_arrive(bar)

    @pl.when(wg == 1)
    def _():
      if synchronised:
        plgpu.barrier_wait(bar)
      o_ref[...] = smem[...]

  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
      num_threads=2,
      thread_name="wg",
      scratch_types=[plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier(num_arrivals=1)],
      interpret=RACES,
  )(x)


@pytest.mark.interpreter_races
def test_race_check_sees_an_unsynchronised_handoff(interpreter_race_reports):
  _handoff(jnp.arange(128, dtype=jnp.float32), synchronised=False)
  assert interpreter_race_reports, "no interpreted kernel ran"
  assert any(s.races_found for s in interpreter_race_reports)


def test_race_check_passes_a_synchronised_handoff(interpreter_race_reports):
  x = jnp.arange(128, dtype=jnp.float32)
  out = _handoff(x, synchronised=True)
  np.testing.assert_array_equal(np.asarray(out), 2.0 * np.asarray(x))
  assert interpreter_race_reports and not any(s.races_found for s in interpreter_race_reports)
