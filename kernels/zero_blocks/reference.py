"""The specification of zero_blocks in plain jnp: which bytes become zero."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, Shaped

_AXES = "LBHNC"


def check_layout(layout: object, shape: tuple[int, ...]) -> str:
  """Validates a layout string against a cache shape.

  Args:
    layout: the physical order of the cache axes, a permutation of `B`, `N`,
      `C` and optionally `L` and `H`.
    shape: the cache shape, one extent per layout letter.

  Returns:
    The layout string.
  """
  if not isinstance(layout, str):
    raise ValueError(f"layout must be a string, got {layout!r}")
  if (
      len(set(layout)) != len(layout)
      or not set(layout) <= set(_AXES)
      or not set("BNC") <= set(layout)
  ):
    raise ValueError(
        f"{layout=} must be a permutation of B, N, C and optionally L, H"
        " (e.g. 'LBNHC', 'BNC')."
    )
  if len(shape) != len(layout):
    raise ValueError(
        f"cache.shape={tuple(shape)} must have one axis per letter of"
        f" {layout=}."
    )
  return layout


def block_geometry(
    shape: tuple[int, ...], layout: str, block_size: int | None
) -> tuple[int, int, int]:
  """Returns `(kernel_blocks, kernel_block_size, kernel_blocks_per_block)`."""
  num_kblocks = shape[layout.index("B")]
  k = shape[layout.index("N")]
  if block_size is None:
    block_size = k
  if (
      not isinstance(block_size, int)
      or isinstance(block_size, bool)
      or block_size < k
      or block_size % k
  ):
    raise ValueError(
        f"{block_size=} must be a positive multiple of the cache's N extent"
        f" {k} (cache.shape={tuple(shape)}, {layout=})."
    )
  r = block_size // k
  if num_kblocks % r:
    raise ValueError(
        f"cache.shape={tuple(shape)} has {num_kblocks} kernel blocks, not a"
        f" multiple of block_size // N extent = {r} ({layout=})."
    )
  return num_kblocks, k, r


def zero_mask(
    num_kblocks: int,
    k: int,
    r: int,
    block_ids: Int[Array, "ids"],
    tail_ids: Int[Array, "tails"],
    tail_valid: Int[Array, "tails"],
) -> jax.Array:
  """`[kernel_blocks, kernel_block_size]` bool: the slots to zero.

  Ids outside `[0, num_kblocks // r)` (the -1 padding) select nothing; a tail
  zeroes the slots at or past its valid count of its logical block.
  """
  kb = jnp.arange(num_kblocks, dtype=jnp.int32)[:, None]
  slot = jnp.arange(k, dtype=jnp.int32)[None, :]
  block = (kb // r)[..., None]
  logical_slot = ((kb % r) * k + slot)[..., None]
  row = lambda x: x.astype(jnp.int32).reshape(1, 1, -1)
  whole = jnp.any(block == row(block_ids), axis=-1)
  tail = jnp.any(
      (block == row(tail_ids)) & (logical_slot >= row(tail_valid)), axis=-1
  )
  return whole | tail


def zero_blocks_reference(
    cache: Shaped[Array, "..."],
    block_ids: Int[Array, "ids"],
    *,
    layout: str = "LBNHC",
    block_size: int | None = None,
    tails: tuple[Int[Array, "tails"], Int[Array, "tails"]] | None = None,
) -> Shaped[Array, "..."]:
  """Zeroes whole logical blocks and tails of a paged cache (the spec).

  Args:
    cache: the cache in kernel-block units, axes in `layout` order.
    block_ids: `[ids]` logical block ids to zero whole; -1 is padding.
    layout: physical axis order, e.g. `"LBNHC"`, `"BNC"`.
    block_size: logical block size in slots, a multiple of the N extent.
    tails: `([tails], [tails])` logical block ids (-1 padding) and valid slot
      counts; slots at or past the count are zeroed.

  Returns:
    The cache with exactly those slots' bytes zero, every other byte as given.
  """
  check_layout(layout, cache.shape)
  num_kblocks, k, r = block_geometry(cache.shape, layout, block_size)
  if tails is None:
    tails = (jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32))
  mask = zero_mask(num_kblocks, k, r, block_ids, *tails)
  if layout.index("N") < layout.index("B"):
    mask = mask.T
  mask_shape = [1] * cache.ndim
  mask_shape[layout.index("B")] = num_kblocks
  mask_shape[layout.index("N")] = k
  mask = mask.reshape(mask_shape)
  # Select on unsigned words so every kept byte, NaN payloads included, is
  # passed through untouched.
  bits = jnp.dtype(f"uint{8 * cache.dtype.itemsize}")
  words = jax.lax.bitcast_convert_type(cache, bits)
  out = jnp.where(mask, jnp.zeros((), bits), words)
  return jax.lax.bitcast_convert_type(out, cache.dtype)


def expected_bytes_numpy(
    cache: np.ndarray,
    block_ids: np.ndarray,
    layout: str,
    block_size: int | None = None,
    tails: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
  """A loop-by-loop NumPy construction of the expected result (for tests)."""
  out = np.array(cache, copy=True)
  view = np.moveaxis(out, (layout.index("B"), layout.index("N")), (0, 1))
  k = view.shape[1]
  r = (block_size or k) // k
  nlb = view.shape[0] // r
  for b in np.asarray(block_ids).tolist():
    if 0 <= b < nlb:
      view[b * r:(b + 1) * r] = 0
  if tails is not None:
    for b, v in zip(*(np.asarray(t).tolist() for t in tails)):
      if not 0 <= b < nlb:
        continue
      for s in range(max(v, 0), r * k):
        view[b * r + s // k, s % k] = 0
  return out
