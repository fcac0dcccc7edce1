"""What both MLA decode kernels (and the merge) share around their tiles: the
geometry, the query's copies and head groups, staged stores, the partial
outputs' shapes and the launch."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith

from .reference import READ_TILE

HEAD_TILE = 64  # wgmma M: heads per CTA
# Slots per KV ring stage, the plan's unit (a block at block size 64): the
# reference's read tile, which sets what "multiply" reads.
TILE = READ_TILE
LATENT = 512
ROPE = 64
HALF = 256  # value channels per consumer warpgroup; also the TMA box limit
CLEAN_COLS = 64  # value channels cleaned per register pass
SLOT_HALF = 32  # slots of a block whose scores one consumer warpgroup computes
NUM_STAGES = 2
NUM_THREADS = 3  # warpgroups per block: two consumers and the TMA producer
LOG2E = math.log2(math.e)
# Ranges per warpgroup the in-kernel profiler can record: its buffer takes
# 3 x 16 B per range from the SMEM the kernel leaves free (224,312 of
# 232,448 B). Past it, events are dropped (`profile_bounds_check`).
PROFILE_RANGES = 168


def bf16_tile(swizzle: int = 64):
  # Tiles of 8 rows and `swizzle` bytes (32 columns at 64: wgmma takes A and
  # B under the same transforms, and P and each warpgroup's score slice are
  # 32 slots wide; 64 columns at 128, `build_kernel(kv_swizzle=128)`).
  return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def load_query(q_ref, row, g, *, head_groups, tail_heads, q_lat, q_rope, bar):
  """Copies head group `g` of row `row` of q `[batch, q_heads, 576]` (GMEM)
  into the query tiles, q_lat `[2, 64, 256]` and q_rope `[64, 64]` (SMEM),
  three copies completing on `bar`. The last head group holds `tail_heads`
  real rows (64 when q is padded): its copies bring those alone, into the
  tiles' first rows (`zero_query_rows` zeroed the rest)."""

  def copy(src_heads, n):
    dst = (lambda ref: ref) if n == HEAD_TILE else (lambda ref: ref.at[pl.ds(0, n)])
    for h in range(2):
      plgpu.copy_gmem_to_smem(
          q_ref.at[row, src_heads, pl.ds(h * HALF, HALF)], dst(q_lat.at[h]), bar)
    plgpu.copy_gmem_to_smem(q_ref.at[row, src_heads, pl.ds(LATENT, ROPE)], dst(q_rope), bar)

  by_head_group(
      g, head_groups=head_groups, tail_heads=tail_heads,
      whole=lambda: copy(pl.ds(g * HEAD_TILE, HEAD_TILE), HEAD_TILE),
      tail=lambda: copy(pl.ds((head_groups - 1) * HEAD_TILE, tail_heads), tail_heads),
  )


def query_rows(heads: int, *, pad: bool = False) -> int:
  """The query heads the decode kernels take for `heads` real ones: `heads`
  itself where it is a multiple of 8 (a TMA box into the query's swizzled
  tiles moves whole 8-row groups), else `heads` padded to head groups of 64
  (and always with `pad`)."""
  return heads if heads % 8 == 0 and not pad else -(-heads // HEAD_TILE) * HEAD_TILE


def real_heads(out, lse, heads: int):
  """A result's first `heads` rows (`out` `[batch, rows, dv]`, `lse` `[batch,
  rows]`): no op where a kernel wrote the real heads alone, else a slice of
  the padded result (an XLA op per output)."""
  if out.shape[1] == heads:
    return out, lse
  return out[:, :heads], lse[:, :heads]


def last_group_rows(heads: int, heads_padded: int) -> int:
  """Real rows of the last head group of 64 when `heads` (`query_rows`) of
  `heads_padded` are real: 64 when none is padding."""
  assert heads_padded - HEAD_TILE < heads <= heads_padded
  assert heads == heads_padded or heads % 8 == 0
  return heads - (heads_padded - HEAD_TILE)


def by_head_group(g, *, head_groups: int, tail_heads: int, whole, tail) -> None:
  """Runs `whole()` in head group `g` when its 64 rows are real and `tail()`
  when it is a last group of `tail_heads` < 64 real rows (both static
  bodies; `g` is the grid's head-group index)."""
  if tail_heads == HEAD_TILE:
    whole()
    return
  last = g == head_groups - 1
  if head_groups > 1:
    pl.when(~last)(whole)
  pl.when(last)(tail)


def zero_query_rows(q_lat, q_rope):
  """Zeroes the query's SMEM tiles, q_lat `[2, 64, 256]` and q_rope `[64,
  64]` bf16, and fences them toward the async proxy: for a query of fewer
  real heads than the tile's 64 rows, whose copies then write the real rows
  alone (after the fence, in the same thread). The padded rows stay zero: no
  copy writes them. Called by the producer before its register decrease (a
  64x64 tile of zeros takes 16 registers per thread)."""
  zero = plgpu.layout_cast(jnp.zeros((HEAD_TILE, CLEAN_COLS), jnp.bfloat16), plgpu.Layout.WGMMA)
  for h in range(2):
    for c in range(HALF // CLEAN_COLS):
      q_lat.at[h, :, pl.ds(c * CLEAN_COLS, CLEAN_COLS)][...] = zero
  q_rope[...] = zero
  plgpu.commit_smem()


def stage_store(buf, value, dst, *, src=None):
  """Stores `value` to GMEM `dst` through SMEM `buf` by one TMA copy (of
  `src`, a slice of `buf` shaped like `dst`, when given: the rows of `value`
  that exist in `dst`, which a register store cannot pick out).

  For 16-bit values: from registers, two 16-bit values per thread and row fill half of each
  32-byte sector a warp store touches, which cost far more than their bytes
  on the H200 (sparse decode's result 4-5.5% of a call, the merge's output
  1.8-3.4 µs at batch 128; kernels/mla_decode/NOTES.md); the copy writes
  whole rows. The caller owns `buf` until
  `plgpu.wait_smem_to_gmem(0, wait_read_only=True)`: only then may it be
  reused, released or left (the copy's writes land before the kernel
  completes).
  """
  buf[...] = value
  plgpu.commit_smem()  # the copy (async proxy) reads what the stores wrote
  plgpu.copy_smem_to_gmem(buf if src is None else src, dst)


def stage_head_group(buf, value, out_at, g, *, heads, head_groups: int, tail_heads: int,
                     lse=None, lse_at=None, lse_buf=None, lse_when=False) -> None:
  """Stores head group `g`'s result through SMEM by TMA (`stage_store`), and
  where `lse_when` its LSE, then waits until the copies have read their
  buffers (the caller may then reuse or release them).

  Args:
    buf: SMEM `[64, n]`: the staging buffer of `value` (`[64, n]`, WGMMA
      layout, one warpgroup's channels of the group's rows).
    out_at: `rows -> GMEM ref` `[len(rows), n]`: where the group's rows go.
    g, heads: the head group's index and its 64 rows (`pl.ds(64 g, 64)`).
    head_groups, tail_heads: as in `by_head_group`. A last group of
      `tail_heads` < 64 real rows stores those alone, its LSE too (staged in
      `lse_buf`, `[64]` f32 SMEM); whole groups store the LSE from registers
      (whole 32-bit rows: no staging needed).
    lse: `[64]` float32 (WGMMA rows); lse_at: `rows -> GMEM ref` of it.
    lse_when: False (no LSE), True, or a function giving a traced bool, called
      where the LSE is stored: which thread stores it.
  """
  tail_rows = pl.ds((head_groups - 1) * HEAD_TILE, tail_heads)
  real = pl.ds(0, tail_heads)

  def store_lse(staged: bool):
    def store():
      if staged:
        stage_store(lse_buf, lse, lse_at(tail_rows), src=lse_buf.at[real])
      else:
        lse_at(heads)[...] = lse

    if lse_when is True:
      store()
    elif lse_when is not False:
      pl.when(lse_when())(store)

  def whole():
    stage_store(buf, value, out_at(heads))
    store_lse(staged=False)

  def tail():  # the last head group's real rows alone
    stage_store(buf, value, out_at(tail_rows), src=buf.at[real])
    store_lse(staged=True)

  by_head_group(g, head_groups=head_groups, tail_heads=tail_heads, whole=whole, tail=tail)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# Rows of a `[64, n]` WGMMA-layout array that one warp of its warpgroup holds.
WARP_ROWS = 16


def store_head_rows(dst, value, g, *, head_groups: int, tail_heads: int, compiled: bool) -> None:
  """Stores head group `g`'s `value` (a `[64, n]` WGMMA-layout array, one per
  warpgroup) to the GMEM ref `dst` (`[64, n]`): all 64 rows, or in a last
  group of `tail_heads` < 64 real heads (`by_head_group`) those alone,
  without the bytes of its padded rows.

  A WGMMA-layout array cannot be sliced by rows (its tile is 64 rows), but
  warp w of the warpgroup holds rows `[16w, 16w + 16)` of it: compiled, the
  warps that hold any of the real rows store theirs (so up to 15 rows past
  them are written too) and the others store nothing; interpreted, the
  slice of the real rows is stored. Either way the rows past them keep
  nothing a reader may use.
  """

  def whole():
    dst[...] = value

  by_head_group(g, head_groups=head_groups, tail_heads=tail_heads, whole=whole,
                tail=lambda: _store_first_rows(dst, value, tail_heads, compiled=compiled))


def _store_first_rows(dst, value, rows: int, *, compiled: bool) -> None:
  """`store_head_rows` of a last head group of `rows` < 64 real heads."""
  if not compiled:
    dst.at[pl.ds(0, rows)][...] = value[:rows]
    return
  warps = -(-rows // WARP_ROWS)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
  def _store(_ctx, v, ref):
    i32 = ir.IntegerType.get_signless(32)
    warp = arith.divui(arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(128, i32)),
                       mgpu_utils.c(32, i32))
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, warp, mgpu_utils.c(warps, i32))):
      # Per-thread stores at each thread's own rows: no collective inside.
      v.store_untiled(ref, swizzle=16, optimized=False)

  _store(value, dst)


def split_outputs(batch, num_splits, heads_padded, partial_cols=None, *, f16=False):
  """Each split's normalised partial O and its LSE, float32: O
  `[batch, num_splits, heads_padded, 512]` and LSE `[batch, num_splits,
  heads_padded]`, or with `partial_cols` O `[batch, 512 / partial_cols,
  heads_padded / 64, num_splits, 64, partial_cols]` and LSE `[batch,
  heads_padded / 64, num_splits, 64]` (`merge_tiling.wide_partials` of the first
  two).

  With `f16`, O holds float16 bits in a bfloat16 array (`scaled_half`'s
  values: staged through the bf16 KV ring, whose SMEM cannot be viewed as
  float16), and a third output holds their scales, float32 by channel half:
  `[batch, num_splits, 2, heads_padded]`, or with `partial_cols` `[batch,
  heads_padded / 64, 2, num_splits, 64]` (a grouped merge CTA's half in one
  contiguous run, as its LSE)."""
  groups = heads_padded // HEAD_TILE
  if partial_cols is None:
    o_shape = (batch, num_splits, heads_padded, LATENT)
    lse_shape = (batch, num_splits, heads_padded)
  else:
    o_shape = (batch, LATENT // partial_cols, groups, num_splits, HEAD_TILE, partial_cols)
    lse_shape = (batch, groups, num_splits, HEAD_TILE)
  outs = (
      jax.ShapeDtypeStruct(o_shape, jnp.bfloat16 if f16 else jnp.float32),
      jax.ShapeDtypeStruct(lse_shape, jnp.float32),
  )
  if not f16:
    return outs
  if partial_cols is None:
    scale_shape = (batch, num_splits, 2, heads_padded)
  else:
    scale_shape = (batch, groups, 2, num_splits, HEAD_TILE)
  return (*outs, jax.ShapeDtypeStruct(scale_shape, jnp.float32))


def scaled_half(o):
  """A float32 `[64, n]` partial as `(bits, scale)`: `o / scale` in float16,
  its bits as bfloat16 (`split_outputs(f16=True)`), and `scale` (`[64]`,
  one per row), the least power of two at or above the row's largest finite
  |o| (1 for a row of zeros; within [2^-126, 2^126]). So `o / scale` is
  within [-1, 1] where finite (within [-4, 4] past 2^126), exact before its
  cast, and NaN or infinite where o is: no finite value overflows float16.
  Powers of two by their bits: `approx_math` keeps neither exp2 nor a
  division exact."""
  mag = jnp.where(jnp.abs(o) < jnp.inf, jnp.abs(o), 0.0).max(axis=1)
  bits = jax.lax.bitcast_convert_type(mag, jnp.int32)
  # Any mantissa carries into the exponent: rounds up to a power of two.
  up = jnp.clip((bits + 0x007FFFFF) & 0x7F800000, 0x00800000, 0x7E800000)
  up = jnp.where(mag > 0.0, up, 0x3F800000)
  inv = jax.lax.bitcast_convert_type(0x7F000000 - up, jnp.float32)  # 2^-e for 2^e
  scaled = (o * jax.lax.broadcast_in_dim(inv, o.shape, [0])).astype(jnp.float16)
  return (jax.lax.bitcast_convert_type(scaled, jnp.bfloat16),
          jax.lax.bitcast_convert_type(up, jnp.float32))


def unscaled(bits, scale):
  """The float32 partials that `split_outputs(f16=True)`'s O and scale hold:
  `bits` `[..., heads, 512]` bfloat16 (float16 bits) times `scale` `[..., 2,
  heads]` (each channel half's), in jnp (exact: a power of two)."""
  o = jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)
  halves = o.reshape(*o.shape[:-1], 2, HALF)
  return (halves * jnp.swapaxes(scale, -1, -2)[..., None]).reshape(o.shape)


def launch(body, *, grid, grid_names, out_type, kernel_name, interpret, profile_dir=None,
           profile_ranges=PROFILE_RANGES, cluster=(), cluster_names=()):
  """The launch of both MLA decode kernels: three warpgroups ("wg") per CTA.

  The last grid axis varies fastest: make it the head group, so that the
  CTAs reading the same KV bytes run side by side and share them in L2.
  Pallas's automatic warpgroup barriers around SMEM stores and before TMA
  copies are off (`unsafe_no_auto_barriers`): the body orders every
  cross-thread hazard itself with commit_smem or mbarriers.

  Args:
    body: the kernel body, `(*input refs, *output refs) -> None`.
    grid, grid_names: the grid and its axis names.
    out_type: the outputs' shapes and dtypes.
    kernel_name: the name profiles show.
    interpret: None (compiled) or the interpreter's parameters.
    profile_dir: where the in-kernel profiler writes each call's trace (it
      records `profile_ranges` ranges per warpgroup; None: no profiler).
    profile_ranges: the ranges per warpgroup the profiler's SMEM buffer
      holds (3 x 16 B each; what the kernel leaves free bounds it).
    cluster, cluster_names: the CTAs of a cluster and their axis names (none:
      no clusters).

  Returns:
    The kernel call.
  """
  return plgpu.kernel(
      body,
      out_type=out_type,
      grid=grid,
      grid_names=grid_names,
      cluster=cluster,
      cluster_names=cluster_names,
      num_threads=NUM_THREADS,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          approx_math=True, unsafe_no_auto_barriers=True,
          **(dict(profile_space=profile_ranges, profile_dir=profile_dir,
                  profile_bounds_check=True) if profile_dir else {}),
      ),
      kernel_name=kernel_name,
      interpret=interpret,
  )
