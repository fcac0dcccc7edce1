"""Rule 1: reset_null_block zeroes exactly block 0; the checkers catch a dirty one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.experimental.pallas import mosaic_gpu as plgpu

import jaxkv

INTERPRET = plgpu.InterpretGPUParams(detect_races=True)


def _random_bytes(shape, dtype, seed):
  itemsize = jnp.dtype(dtype).itemsize
  raw = np.random.default_rng(seed).integers(1, 256, size=(*shape, itemsize), dtype=np.uint8)
  return jnp.asarray(raw.view(jnp.dtype(dtype)).reshape(shape))


@pytest.mark.parametrize(
    "shape, layout, block_size, dtype",
    [
        ((6, 8, 576), "BNC", None, jnp.bfloat16),
        ((12, 4, 576), "BNC", 8, jnp.bfloat16),      # two kernel blocks per logical block
        ((3, 6, 8, 2, 16), "LBNHC", None, jnp.float32),
        ((2, 6, 2, 8, 16), "LHBNC", None, jnp.float8_e4m3fn),
        ((2, 5, 1, 256), "LBNC", None, jnp.uint8),   # a hybrid raw byte pool
    ],
)
def test_reset_null_block_zeroes_block0_only(shape, layout, block_size, dtype):
  cache = _random_bytes(shape, dtype, seed=len(shape))
  before = np.asarray(cache).copy()
  with pytest.raises(AssertionError, match="null block"):
    jaxkv.assert_null_block_clean(cache, layout=layout, block_size=block_size)
  after = jaxkv.reset_null_block(cache, layout=layout, block_size=block_size, interpret=INTERPRET)
  jaxkv.assert_null_block_clean(after, layout=layout, block_size=block_size)
  kernel_block = shape[layout.index("N")]
  ratio = (block_size or kernel_block) // kernel_block
  b_axis = layout.index("B")
  mine = np.asarray(after)
  for b in range(shape[b_axis]):
    got, want = np.take(mine, b, axis=b_axis), np.take(before, b, axis=b_axis)
    if b < ratio:
      assert not np.any(got.view(np.uint8) if got.dtype.itemsize == 1 else got.view(f"u{got.dtype.itemsize}"))
    else:
      np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_checkify_form_inside_jit():
  cache = _random_bytes((4, 8, 64), jnp.bfloat16, seed=1)

  @jax.jit
  def check(c):
    jaxkv.check_null_block_clean(c, layout="BNC")
    return c

  err, _ = checkify.checkify(check)(cache)
  with pytest.raises(checkify.JaxRuntimeError, match="null block"):
    err.throw()
  clean = cache.at[0].set(0)
  err, _ = checkify.checkify(check)(clean)
  err.throw()


def test_bad_layout():
  cache = jnp.ones((4, 8, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="layout"):
    jaxkv.assert_null_block_clean(cache, layout="BC")
  with pytest.raises(ValueError, match="block_size"):
    jaxkv.assert_null_block_clean(cache, layout="BNC", block_size=12)


def test_slots_from_block_table_maps_null_block_to_minus_one():
  table = jnp.array([[3, 5, 0], [0, 0, 0], [2, 0, 0]], jnp.int32)
  pos = jnp.array([5, 0, 9], jnp.int32)
  got = jaxkv.slots_from_block_table(table, pos, 4)
  # row 0: block 5 slot 1; row 1: padded row -> -1; row 2: position 9 is in block index 2 (padding) -> -1
  np.testing.assert_array_equal(got, [21, -1, -1])
  raw = jaxkv.slots_from_block_table(table, pos, 4, skip_null_block=False)
  np.testing.assert_array_equal(raw, [21, 0, 1])
  np.testing.assert_array_equal(
      jaxkv.slots_from_block_table(table, jnp.array([-1, 12, 3], jnp.int32), 4), [-1, -1, 11]
  )
