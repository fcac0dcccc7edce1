"""The sparse kernel's row gather: per-thread `cp.async` straight into swizzled tiles.

A tile's rows are arbitrary cache slots. One TMA copy per row cannot write a
wgmma operand (an operand's 8-row tiles interleave the rows), and a row-major
landing tile costs a register relayout per tile. Here each of the producer
warpgroup's 128 threads copies its 16-byte pieces of the rows itself, with
`cp.async` (global -> shared, no registers in between), to the address the
operand's tiling and swizzle give each piece; each thread then arrives on the
stage's mbarrier with `cp.async.mbarrier.arrive.noinc`, an arrival that happens
when that thread's copies have landed, so the stage completes with its last
byte and the producer never waits for a tile (both stages can be filling).

Pallas exposes no per-thread gathered copy, so this is written in Mosaic GPU's
own IR (`plgpu.inline_mgpu`) and runs compiled only; the interpreter's
producer copies rows with one-row TMA copies instead (`producer.py`).

Layout (bf16, tiles of 8 rows and `swizzle` bytes, as `mla_decode.kernel`
allocates its operands, `bf16_tile(swizzle)`): with `cols = swizzle // 2`,
element (row, col) of a `[rows, width]` buffer lives in the `8 * swizzle`-byte
tile `(row // 8, col // cols)` (row-major over tiles), at byte
`(row % 8) * swizzle + 2 * (col % cols)` in it, with the 16-byte chunk index
(bits 4 up, `swizzle // 16` chunks) XORed with bits 7 up of that in-tile
offset: at 64 bytes (32-column tiles) with `(row % 8) // 2`, at 128 (64-column
tiles) with `row % 8`. A thread's 16-byte piece of a row's 128-byte span lands
in one of the span's two tiles at 64 bytes, in its one tile at 128.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, nvvm, vector

from jaxkv.kernels.mla_decode.config import KV_SWIZZLES
from jaxkv.kernels.mla_decode.layout import bf16_tile

HEAD_DIM = 576
LATENT = 512
HALF = 256  # channels per latent half buffer
PIECE = 16  # bytes per cp.async
SPAN = 128  # bytes of a row that one pass of 8 threads copies
LANES_PER_ROW = 8  # threads per 128-byte span of a row
ROWS_PER_PASS = 128 // LANES_PER_ROW  # rows one pass of the warpgroup covers
SPANS = HEAD_DIM * 2 // SPAN  # 9 spans of 128 bytes per row
WARPS = 4  # per warpgroup
# int32s of `null_first_invalid`'s SMEM scratch: a slot per warp.
FIRST_INVALID_SCRATCH = WARPS


def _row_ids_shape(tile: int) -> tuple[int]:
  return (128 * (tile // ROWS_PER_PASS),)  # one int per thread and row it copies


def _row_ids_layout(tile: int):
  # Thread t's register p is the id of its row t // 8 + 16 p (`row_ids`).
  return plgpu.Layout.WG_STRIDED(_row_ids_shape(tile), vec_size=1)


def _row_ids_type(tile: int):
  """A `row_ids` array's type, for `inline_mgpu`'s `return_type`."""
  return plgpu.ShapeDtypeStruct(_row_ids_shape(tile), jnp.int32, layout=_row_ids_layout(tile))


def _thread_rows(tile: int):
  """This thread's rows of a tile (inside an `inline_mgpu` body): row t // 8,
  then every 16th, the rows whose 16-byte pieces `issue_gather` copies."""
  i32 = ir.IntegerType.get_signless(32)
  t = arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(128, i32))
  row0 = arith.divui(t, mgpu_utils.c(LANES_PER_ROW, i32))
  return [arith.addi(row0, mgpu_utils.c(p * ROWS_PER_PASS, i32))
          for p in range(tile // ROWS_PER_PASS)]


def row_ids(ids, *, tile: int) -> jax.Array:
  """The ids of the rows each thread copies, from `ids` (`[tile]` int32 SMEM)
  into registers: an int32 array whose register p in thread t is
  `ids[t // 8 + 16 p]`, for `null_first_invalid` and `issue_gather`.

  Loaded before the producer waits for the tile's stage, so that the copies
  start at once when it comes free: the values stay in registers across the
  wait (four per thread). Called by all 128 threads of one warpgroup,
  compiled only.
  """
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=_row_ids_type(tile))
  def _load(_ctx, ids_ref):
    index = ir.IndexType.get()
    return _from_scalars(
        [memref.load(ids_ref, [arith.index_cast(index, r)]) for r in _thread_rows(tile)], tile)

  return _load(ids)


def _scalars(ids):
  """The int32 scalars of a `row_ids` array in this thread, by register."""
  return [vector.extract(reg, [], [0]) for reg in ids.registers.flat]


def _from_scalars(values, tile: int):
  """A `row_ids` array from this thread's int32 scalars, one per register."""
  i32 = ir.IntegerType.get_signless(32)
  regs = np.empty((len(values),), dtype=object)
  for p, v in enumerate(values):
    regs[p] = vector.broadcast(ir.VectorType.get((1,), i32), v)
  return mgpu_fa.FragmentedArray(
      _registers=regs, _layout=_row_ids_layout(tile).to_mgpu(), _is_signed=True)


def issue_gather(
    ids, cache, k_lat, k_rope, idx_src, idx_dst, bar, *, tile: int, swizzle: int,
) -> None:
  """Starts copying rows `cache[ids[r]]` into `k_lat`/`k_rope` row r, and `idx_src`
  into `idx_dst`; `bar` completes its phase when all of them landed.

  Called by all 128 threads of one warpgroup, compiled only.

  Args:
    ids: the tile's cache rows as `row_ids` holds them in registers. An id
      outside the cache (-1, or past its last row) zero-fills row r (`cp.async`
      with a source size of 0: nothing is read), so that no row of a tile
      holds what an earlier tile, of this row or another, left there.
    cache: `[num_rows, 576]` bf16 GMEM ref.
    k_lat: `[2, tile, 256]` bf16 SMEM ref (the two latent halves) under
      `transforms`.
    k_rope: `[tile, 64]` bf16 SMEM ref under `transforms`.
    idx_src: `[tile]` int32 GMEM ref (the tile's indices, 16-byte aligned).
    idx_dst: `[tile]` int32 SMEM ref, where they land beside the rows.
    bar: `[2]` int32 SMEM ref holding an mbarrier (`init_barriers`, 128
      arrivals): each thread's arrival is its copies' completion
      (`cp.async.mbarrier.arrive.noinc`), so the phase completes when the
      whole tile has landed and nobody waits for it here.
    tile: rows per call, a multiple of 16.
    swizzle: the operands' layout, `bf16_tile(swizzle)` (64 or 128; the
      module's docstring).
  """
  assert tile % ROWS_PER_PASS == 0
  assert swizzle in KV_SWIZZLES
  transforms = bf16_tile(swizzle)
  cols = swizzle // 2  # columns per operand tile
  tile_bytes = 8 * swizzle  # one [8, cols] bf16 tile
  chunks = swizzle // PIECE  # 16-byte chunks per tile row
  span_tiles = SPAN // swizzle  # tiles one 128-byte span of a row covers
  lat_tiles_per_row = HALF // cols  # tiles across one 8-row band of a half
  rope_tiles_per_row = (HEAD_DIM - LATENT) // cols

  @plgpu.inline_mgpu(
      arg_types=(
          _row_ids_layout(tile),
          plgpu.RefType(),
          plgpu.RefType(transforms=transforms),
          plgpu.RefType(transforms=transforms),
          plgpu.RefType(),
          plgpu.RefType(),
          plgpu.RefType(),
      )
  )
  def _issue(_ctx, row_ids_, cache_ref, lat_ref, rope_ref, idx_src_ref, idx_dst_ref, bar_ref):
    i32 = ir.IntegerType.get_signless(32)
    i64 = ir.IntegerType.get_signless(64)
    i8 = ir.IntegerType.get_signless(8)
    c32 = lambda v: mgpu_utils.c(v, i32)
    num_rows = ir.MemRefType(cache_ref.type).shape[0]

    t = arith.remui(mgpu_utils.thread_idx(), c32(128))
    lane = arith.remui(t, c32(LANES_PER_ROW))  # 16-byte piece within a 128-byte span
    row0 = arith.divui(t, c32(LANES_PER_ROW))  # first row; then every 16th
    # Inside an 8-row tile: the row's `swizzle`-byte line, the swizzled piece
    # (its chunk index XOR bits 7 up of the line's offset, `in_row * swizzle`).
    in_row = arith.remui(row0, c32(8))
    line_bits = arith.shrui(in_row, c32(SPAN // swizzle - 1))  # in_row * swizzle / 128
    chunk = arith.xori(arith.remui(lane, c32(chunks)), line_bits)
    in_tile = arith.addi(arith.muli(in_row, c32(swizzle)), arith.muli(chunk, c32(PIECE)))
    band = arith.divui(row0, c32(8))
    col_tile = arith.divui(lane, c32(chunks))  # which of a span's tiles (0 at 128)

    def dst_ptr(ref, tiles_per_band):
      tile_idx = arith.addi(arith.muli(band, c32(tiles_per_band)), col_tile)
      off = arith.addi(arith.muli(tile_idx, c32(tile_bytes)), in_tile)
      return mgpu_utils.getelementptr(mgpu_utils.memref_ptr(ref), [off], i8)

    lat_ptr = dst_ptr(lat_ref, lat_tiles_per_row)
    rope_ptr = dst_ptr(rope_ref, rope_tiles_per_row)
    cache_ptr = llvm.addrspacecast(
        llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(cache_ref)
    )

    def copy_row(src, p, src_size):
      # Row r = row0 + 16p: two 8-row bands further per pass. `src_size`: 16,
      # or 0 to fill the row with zeros.
      for span in range(SPANS):
        if span < LATENT * 2 // SPAN:
          half, sub = divmod(span, HALF * 2 // SPAN)
          off = (
              half * (tile // 8) * lat_tiles_per_row * tile_bytes
              + p * 2 * lat_tiles_per_row * tile_bytes
              + sub * span_tiles * tile_bytes
          )
          dst = mgpu_utils.getelementptr(lat_ptr, [off], i8)
        else:
          off = p * 2 * rope_tiles_per_row * tile_bytes
          dst = mgpu_utils.getelementptr(rope_ptr, [off], i8)
        piece = mgpu_utils.getelementptr(src, [span * PIECE * LANES_PER_ROW], i8)
        nvvm.cp_async_shared_global(dst, piece, PIECE, nvvm.LoadCacheModifierKind.CG,
                                    cp_size=src_size)

    for p, raw in enumerate(_scalars(row_ids_)):
      sid = arith.minsi(arith.maxsi(raw, c32(0)), c32(num_rows - 1))
      src_off = arith.addi(
          arith.muli(arith.extui(i64, sid), mgpu_utils.c(HEAD_DIM * 2, i64)),
          arith.extui(i64, arith.muli(lane, c32(PIECE))),
      )
      src = mgpu_utils.getelementptr(cache_ptr, [src_off], i8)
      # (The clamped address stays inside the cache; a size of 0 reads none of it.)
      copy_row(src, p, arith.select(_inside(raw, num_rows), c32(PIECE), c32(0)))
    # The indices: one 16-byte piece (4 of them) per thread of the first few.
    idx_pieces = tile * 4 // PIECE
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, t, c32(idx_pieces))):
      off = arith.muli(t, c32(PIECE))
      src = llvm.addrspacecast(
          llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(idx_src_ref)
      )
      nvvm.cp_async_shared_global(
          mgpu_utils.getelementptr(mgpu_utils.memref_ptr(idx_dst_ref), [off], i8),
          mgpu_utils.getelementptr(src, [off], i8),
          PIECE,
          nvvm.LoadCacheModifierKind.CG,
      )
    nvvm.cp_async_mbarrier_arrive(mgpu_utils.memref_ptr(bar_ref), noinc=True)

  _issue(ids, cache, k_lat, k_rope, idx_src, idx_dst, bar)


def _inside(raw, num_rows: int):
  """Whether the int32 id `raw` names a row of a `num_rows`-row cache: one
  unsigned compare (a negative id is a huge unsigned one)."""
  i32 = ir.IntegerType.get_signless(32)
  return arith.cmpi(arith.CmpIPredicate.ult, raw, mgpu_utils.c(num_rows, i32))


def null_first_invalid(ids, scratch, *, tile: int, num_rows: int) -> jax.Array:
  """`ids` (as `row_ids` holds them) with the tile's first invalid id (-1, or
  any id outside the `num_rows` rows of the cache), if any, replaced by 0:
  "multiply" copies the null block's slot 0 for that row (and zero-fills the
  rows of the tile's other invalid ids), so a non-finite null block reaches the
  accumulator with p = 0 as in production kernels. The rows' indices the
  consumers mask by are copied from GMEM and keep their values.

  The first such row: each thread's first among the rows it copies, the
  warp's by one `redux.sync`, the four warps' through `scratch` (`[4]` int32
  SMEM) and a warpgroup barrier. The producer calls it before it waits for
  the tile's stage, so that after the wait it only copies.

  Called by all 128 threads of one warpgroup, compiled only; the caller
  orders the scratch's reuse across tiles with a warpgroup barrier.
  """
  @plgpu.inline_mgpu(
      arg_types=(_row_ids_layout(tile), plgpu.RefType()), return_type=_row_ids_type(tile)
  )
  def _scan(_ctx, row_ids_, scratch_ref):
    i32 = ir.IntegerType.get_signless(32)
    index = ir.IndexType.get()
    c32 = lambda v: mgpu_utils.c(v, i32)
    t = arith.remui(mgpu_utils.thread_idx(), c32(128))
    rows, raws = _thread_rows(tile), _scalars(row_ids_)
    first = c32(tile)
    for r, raw in reversed(list(zip(rows, raws))):
      first = arith.select(_inside(raw, num_rows), first, r)
    first = nvvm.redux_sync(first, mgpu_utils.ReductionKind.MIN, c32(-1))
    warp = arith.divui(t, c32(32))
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, arith.remui(t, c32(32)), c32(0))):
      memref.store(first, scratch_ref, [arith.index_cast(index, warp)])
    mgpu_utils.warpgroup_barrier()
    first = c32(tile)
    for w in range(WARPS):
      first = arith.minsi(first, memref.load(scratch_ref, [arith.constant(index, w)]))
    return _from_scalars(
        [arith.select(arith.cmpi(arith.CmpIPredicate.eq, r, first), c32(0), raw)
         for r, raw in zip(rows, raws)], tile)

  return _scan(ids, scratch)


def init_barriers(bars, *, arrivals: int) -> None:
  """Initialises the mbarriers in `bars` (`[n, 2]` int32 SMEM ref, 8 bytes each).

  Called by one warpgroup (its first thread initialises), compiled only;
  other threads may use the barriers once a barrier (a warpgroup barrier, or
  an mbarrier the initialising thread arrives on afterwards) orders them
  after this.
  """

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def _init(_ctx, bars_ref):
    i32 = ir.IntegerType.get_signless(32)
    i8 = ir.IntegerType.get_signless(8)
    first = arith.cmpi(
        arith.CmpIPredicate.eq,
        arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(128, i32)),
        mgpu_utils.c(0, i32),
    )
    base = mgpu_utils.memref_ptr(bars_ref)
    for k in range(ir.MemRefType(bars_ref.type).shape[0]):
      nvvm.mbarrier_init(
          mgpu_utils.getelementptr(base, [8 * k], i8),
          mgpu_utils.c(arrivals, i32),
          predicate=first,
      )
    nvvm.fence_mbarrier_init()

  _init(bars)


def wait_barrier(bar, *, parity: int) -> None:
  """Waits for the phase of parity `parity` of the mbarrier in `bar` (`[2]` int32
  SMEM ref), then fences so that this thread's wgmma (the async proxy) sees
  what the phase made visible (bytes `cp.async` wrote). Compiled only."""

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def _wait(_ctx, bar_ref):
    i32 = ir.IntegerType.get_signless(32)
    nvvm.mbarrier_try_wait_parity(
        mgpu_utils.memref_ptr(bar_ref), mgpu_utils.c(parity, i32),
        mgpu_utils.c(10_000_000, i32),
    )
    nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

  _wait(bar)


def warpgroup_barrier() -> None:
  """A barrier of this warpgroup's 128 threads alone (no memory fence)."""

  @plgpu.inline_mgpu()
  def _barrier(_ctx):
    mgpu_utils.warpgroup_barrier()

  _barrier()
