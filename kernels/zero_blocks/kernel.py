"""Mosaic GPU bodies of zero_blocks: zero row ranges of a cache viewed as rows.

The wrapper views the cache as `[rows, width]` unsigned words, a row being the
bytes of one slot that are contiguous in memory, and hands the kernel a list of
work items `(first_row, num_rows)`, each a contiguous run of rows to zero. A
persistent grid of CTAs walks the items `cta, cta + num_ctas, ...`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Register stores: one element per thread of a warpgroup, so that any start
# offset is aligned.
_LANES = 128


def _for_my_items(items_ref, body, prefetch):
  """Runs `body(first, count)` for every non-empty item this CTA owns.

  The item `prefetch` steps ahead is loaded before the current one is
  processed, so that the GMEM load latency overlaps issuing stores.
  """
  cta = jax.lax.axis_index("cta")
  num_ctas = jax.lax.axis_size("cta")
  num_items = items_ref.shape[0]

  def load(j):
    i = cta + j * num_ctas
    safe = jnp.minimum(i, num_items - 1)
    first = items_ref[safe, 0]
    count = jnp.where(i < num_items, items_ref[safe, 1], 0)
    return first, count

  def step(j, ahead):
    first, count = ahead[0]
    nxt = load(j + prefetch)

    @pl.when(count > 0)
    def _():
      body(first, count)

    return (*ahead[1:], nxt)

  jax.lax.fori_loop(
      0, pl.cdiv(num_items, num_ctas), step,
      tuple(load(j) for j in range(prefetch)),
  )


def zero_rows_tma_kernel(items_ref, cache_ref, zero_smem, *, prefetch: int):
  """Zeroes row runs with TMA stores of an SMEM zero tile.

  Args:
    items_ref: `[items, 2]` int32 GMEM, `(first_row, num_rows)`; empty items
      have `num_rows == 0`.
    cache_ref: `[rows, width]` uint GMEM, aliased with the output; `width`
      is at most 256 and `width * itemsize` a multiple of 16 bytes, so a run
      of rows is one contiguous TMA box.
    zero_smem: `[tile_rows, width]` uint SMEM; tile_rows a power of two.
    prefetch: how many items ahead to load.
  """
  tile_rows = zero_smem.shape[0]
  zero_smem[...] = jnp.zeros(zero_smem.shape, zero_smem.dtype)
  plgpu.commit_smem()

  def store(first, rows):
    plgpu.copy_smem_to_gmem(
        zero_smem.at[pl.ds(0, rows)], cache_ref.at[pl.ds(first, rows)]
    )

  def zero_run(first, count):
    def full_tile(q, carry):
      store(first + q * tile_rows, tile_rows)
      return carry

    jax.lax.fori_loop(0, count // tile_rows, full_tile, None)
    # The remainder, as disjoint power-of-two pieces (overlapping stores would
    # race with each other).
    done = first + (count // tile_rows) * tile_rows
    rows = tile_rows // 2
    while rows >= 1:

      @pl.when((count & rows) != 0)
      def _(rows=rows):
        store(done + (count & (tile_rows - 1) & ~(2 * rows - 1)), rows)

      rows //= 2

  _for_my_items(items_ref, zero_run, prefetch)
  plgpu.wait_smem_to_gmem(0)


def zero_rows_regs_kernel(items_ref, cache_ref, *, row_width: int, prefetch: int):
  """Zeroes row runs with register stores (rows not a multiple of 16 bytes).

  TMA cannot address rows whose byte size is not a multiple of 16 (e.g. a bf16
  cache whose slot axis is innermost); here every thread stores one element, so
  any offset and any length is exact.

  Args:
    items_ref: `[items, 2]` int32 GMEM, `(first_row, num_rows)`.
    cache_ref: `[rows * row_width]` uint GMEM, aliased with the output.
    row_width: elements per row.
    prefetch: how many items ahead to load.
  """
  zeros = plgpu.layout_cast(
      jnp.zeros((_LANES,), cache_ref.dtype),
      plgpu.Layout.WG_STRIDED((_LANES,), vec_size=1),
  )

  def zero_run(first, count):
    start = first * row_width
    size = count * row_width

    def lanes(q, carry):
      cache_ref.at[pl.ds(start + q * _LANES, _LANES)][...] = zeros
      return carry

    jax.lax.fori_loop(0, size // _LANES, lanes, None)
    rest = start + (size // _LANES) * _LANES

    def one(q, carry):
      cache_ref[rest + q] = jnp.zeros((), cache_ref.dtype)
      return carry

    jax.lax.fori_loop(0, size % _LANES, one, None)

  _for_my_items(items_ref, zero_run, prefetch)
