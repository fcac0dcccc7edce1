"""Rule 1 enforced: reset the null block (block 0) and check that it is clean."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


def _block0_slices(shape: tuple[int, ...], layout: str, block_size: int | None) -> tuple[slice, ...]:
  if len(layout) != len(shape):
    raise ValueError(f"layout={layout!r} has {len(layout)} axes but {shape=}")
  if "B" not in layout or "N" not in layout:
    raise ValueError(f"layout={layout!r} must name a B (blocks) and an N (slots) axis")
  kernel_block = shape[layout.index("N")]
  block_size = kernel_block if block_size is None else block_size
  if block_size % kernel_block:
    raise ValueError(f"{block_size=} must be a multiple of the N extent {kernel_block}")
  ratio = block_size // kernel_block
  return tuple(slice(0, ratio) if ax == "B" else slice(None) for ax in layout)


def reset_null_block(cache, *, layout: str = "BNC", block_size: int | None = None, interpret=None):
  """Zeroes logical block 0 (every layer, head, slot and channel) in one launch.

  Args:
    cache: a cache array in kernel-block units (see `jaxkv.kernels.zero_blocks`),
      e.g. an MLA cache `[num_blocks, block_size, 576]` with layout "BNC", or a
      hybrid raw pool `[num_tensors, num_blocks, 1, page_bytes]` uint8 with
      layout "LBNC". Donate it: only block 0 is written.
    layout: the axis order of `cache`.
    block_size: the logical block size, a multiple of the N extent.
    interpret: as for every kernel.

  Returns:
    The cache with block 0 all zero bytes.
  """
  from jaxkv.kernels import zero_blocks

  _block0_slices(cache.shape, layout, block_size)
  with jax.named_scope("jaxkv.reset_null_block"):
    return zero_blocks(
        cache, jnp.zeros((1,), jnp.int32), layout=layout, block_size=block_size, interpret=interpret
    )


def assert_null_block_clean(cache, *, layout: str = "BNC", block_size: int | None = None) -> None:
  """Raises AssertionError unless every byte of block 0 is zero (NumPy, for tests and audits)."""
  block0 = np.asarray(jax.device_get(cache))[_block0_slices(cache.shape, layout, block_size)]
  raw = block0.view(f"u{block0.dtype.itemsize}")
  nonzero = np.count_nonzero(raw)
  if nonzero:
    raise AssertionError(f"the null block holds {nonzero} non-zero elements of {raw.size} ({layout=})")


def check_null_block_clean(cache, *, layout: str = "BNC", block_size: int | None = None) -> None:
  """The jittable form: a `checkify` check that block 0 is all zero bits (use under `debug=True`)."""
  block0 = cache[_block0_slices(cache.shape, layout, block_size)]
  bits = jax.lax.bitcast_convert_type(block0, _uint_of(block0.dtype))
  checkify.check(jnp.all(bits == 0), "jaxkv: the null block (block 0) is not all zeros")


def _uint_of(dtype):
  return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(dtype).itemsize]
