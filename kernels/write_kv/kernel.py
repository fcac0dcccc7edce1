"""Mosaic GPU body of write_kv: TMA-load token rows into SMEM, TMA-store each to its slot.

The cache is seen as a table of rows `[rows, R, K]`: one row is the bytes of
one slot of one (layer, kv head) combination that the layout keeps contiguous
(every axis after N), split as R x K elements so that each TMA box dimension
stays within 256. The tokens' values arrive as `[tokens, Q, R, K]` where Q
enumerates the cache's non-B axes before N, in the cache's order.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


@dataclasses.dataclass(frozen=True)
class RowGeometry:
  """Static map from (slot, q) to a row of the `[rows, R, K]` cache view.

  Attributes:
    slot_extent: N, the slots per (kernel) block of the array.
    num_slots: B * N; slots at or past it are never written.
    block_stride: rows between consecutive blocks.
    q_extents: extents of the non-B axes before N, in cache order.
    q_strides: rows between consecutive indices of each of those axes.
  """

  slot_extent: int
  num_slots: int
  block_stride: int
  q_extents: tuple[int, ...]
  q_strides: tuple[int, ...]

  @classmethod
  def from_layout(cls, shape: tuple[int, ...], layout: str) -> RowGeometry:
    pre = layout[: layout.index("N")]
    dims = dict(zip(layout, shape))
    n = dims["N"]
    strides = {}
    stride = n
    for axis in reversed(pre):
      strides[axis] = stride
      stride *= dims[axis]
    others = [a for a in pre if a != "B"]
    return cls(
        slot_extent=n,
        num_slots=dims["B"] * n,
        block_stride=strides["B"],
        q_extents=tuple(dims[a] for a in others),
        q_strides=tuple(strides[a] for a in others),
    )

  @property
  def num_q(self) -> int:
    return math.prod(self.q_extents)

  def q_offset(self, q):
    """Row offset of the flat index q over the non-B axes (static divisors)."""
    offset = 0
    rest = q
    for extent, stride in zip(reversed(self.q_extents), reversed(self.q_strides)):
      offset = offset + (rest % extent) * stride
      rest = rest // extent
    return offset


def write_kv_kernel(
    slot_ref,
    kv_ref,
    cache_ref,
    kv_smem,
    barrier,
    *,
    geometry: RowGeometry,
    tokens_per_block: int,
    q_per_block: int,
):
  """Writes `tokens_per_block` tokens x `q_per_block` rows of each.

  Args:
    slot_ref: [tokens_padded] int32 in GMEM; -1 (or out of range) skips.
    kv_ref: [tokens_padded, Q, R, K] in GMEM, the tokens' rows.
    cache_ref: [rows, R, K] in GMEM, updated in place (aliased).
    kv_smem: [tokens_per_block, q_per_block, R, K] SMEM staging tile.
    barrier: TMA load barrier.
  """
  t_block = jax.lax.axis_index("t")
  q_block = jax.lax.axis_index("q")
  t0 = t_block * tokens_per_block
  q0 = q_block * q_per_block
  plgpu.copy_gmem_to_smem(
      kv_ref.at[pl.ds(t0, tokens_per_block), pl.ds(q0, q_per_block)],
      kv_smem,
      barrier,
  )
  plgpu.barrier_wait(barrier)
  for j in range(tokens_per_block):
    slot = slot_ref[t0 + j]
    # A traced out-of-range slot is treated as padding: it must never write.
    valid = (slot >= 0) & (slot < geometry.num_slots)

    @pl.when(valid)
    def _store_token(j=j, slot=slot):
      base = (slot // geometry.slot_extent) * geometry.block_stride + (
          slot % geometry.slot_extent
      )

      def store(qq):
        row = base + geometry.q_offset(q0 + qq)
        plgpu.copy_smem_to_gmem(kv_smem.at[j, qq], cache_ref.at[row])

      if q_per_block <= 8:
        for qq in range(q_per_block):
          store(qq)
      else:
        @pl.loop(0, q_per_block)
        def _(qq):
          store(qq)

  plgpu.wait_smem_to_gmem(0)


def launch(
    cache_rows,
    kv_rows,
    slots,
    *,
    geometry: RowGeometry,
    tokens_per_block: int,
    q_per_block: int,
    interpret,
):
  """Runs the kernel over `[rows, R, K]` cache bytes, updating them in place.

  Args:
    cache_rows: [rows, R, K] unsigned-int view of the cache.
    kv_rows: [tokens_padded, Q, R, K] same dtype; tokens_padded is a multiple
      of tokens_per_block and Q of q_per_block.
    slots: [tokens_padded] int32.
    geometry: the static row map.
    tokens_per_block: tokens per grid step.
    q_per_block: rows of each token per grid step.
    interpret: None for a compiled launch, else the interpreter parameters.

  Returns:
    The updated `[rows, R, K]` array (aliased to `cache_rows`).
  """
  tokens, num_q, r, k = kv_rows.shape
  body = functools.partial(
      write_kv_kernel,
      geometry=geometry,
      tokens_per_block=tokens_per_block,
      q_per_block=q_per_block,
  )
  call = plgpu.kernel(
      body,
      out_type=(),
      grid=(tokens // tokens_per_block, num_q // q_per_block),
      grid_names=("t", "q"),
      scratch_types=[
          plgpu.SMEM((tokens_per_block, q_per_block, r, k), kv_rows.dtype),
          plgpu.Barrier(),
      ],
      kernel_name="jaxkv_write_kv",
      interpret=interpret,
  )

  def run(cache_ref):
    call(slots, kv_rows, cache_ref)

  return pl.run_state(run)(cache_rows)


def row_split(width: int, itemsize: int) -> tuple[int, int] | None:
  """Splits a row of `width` elements as R x K for TMA, or None if it cannot.

  K * itemsize must be a multiple of 16 bytes and both R and K at most 256.
  """
  for k in range(min(width, 256), 0, -1):
    if width % k == 0 and width // k <= 256 and (k * itemsize) % 16 == 0:
      return width // k, k
  return None


UINT_OF_SIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
