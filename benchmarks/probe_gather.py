"""Probe: how fast a CTA gathers sparse decode's tiles, by each way of copying rows.

Usage: python benchmarks/probe_gather.py [--ctas 132 264] [--tiles 32] [--ways ...]
         [--rows 524288 16384] [--share 1 2]

Compiled only (the gathers are Mosaic GPU IR that the interpreter does not run).

Every CTA (one warpgroup) gathers `--tiles` tiles of 64 random cache rows (576
bf16 channels, 72 KB a tile) through a ring of two stages, as the sparse
decode kernel's producer does, but with nobody consuming: a stage is refilled
as soon as its last tile landed. The kernel's time over its tiles is the
gather's own rate, with two tiles in flight, the ceiling that the decode
kernel's chain of a tile is co-limited with at 128 heads (NOTES.md,
thirty-fifth stop). Ways:

- `cp_async`: `gather.issue_gather`, the kernel's own: each of 128 threads
  copies 16-byte pieces straight into the 128-byte-swizzled operand tiles
  (72 pieces a row).
- `tma_spans`: one TMA copy per 128-byte span of a row (9 a row, 576 a tile),
  a `[1, 64]` box with the 128-byte swizzle, into the same operand tiles: TMA
  swizzles by the SMEM address, so a row's span lands in place at its line of
  an 8-row tile. One elected thread of each warp issues its 16 rows' copies.
- `tma_rows`: one TMA copy per row (a `[1, 9, 64]` box, 1152 bytes) into a
  row-major buffer that no wgmma can read: what per-row TMA moves at best.

Before timing, each way's last two tiles are read back and compared with the
cache's rows (ids outside the cache, -1 among them, must land zeros), so a
way whose copies land wrong fails loudly instead of timing well. With
`--share 2`, CTAs 2k and 2k + 1 gather the same ids side by side, as the two
64-head groups of a 128-head row do in the decode kernel.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, nvvm

from jaxkv.kernels._common import num_sms
from jaxkv.kernels.mla_decode.layout import HALF, ROPE, bf16_tile
from jaxkv.kernels.sparse_mla_decode.config import TILE
from jaxkv.kernels.sparse_mla_decode.gather import (
    HEAD_DIM as DIM,
    SPANS,
    WARPS,
    init_barriers,
    issue_gather,
    row_ids,
    wait_barrier,
    warpgroup_barrier,
)

SWIZZLE = 128
SPAN = SWIZZLE // 2  # channels of one 128-byte span (`gather.SPAN` bytes)
ROWS_PER_WARP = TILE // WARPS
TILE_BYTES = 8 * SWIZZLE  # one [8, 64] bf16 operand tile
WAYS = ("cp_async", "tma_spans", "tma_rows")


def _tma_issue(stage_refs, *, way: str):
  """One tile's copies by TMA: `inline_mgpu`, called by all 128 threads."""
  raw = way == "tma_rows"
  transforms = () if raw else bf16_tile(SWIZZLE)
  n_dst = 1 if raw else 2

  @plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(), plgpu.RefType(),
                 *[plgpu.RefType(transforms=transforms)] * n_dst, plgpu.RefType()))
  def _issue(ctx, ids_ref, cache_ref, *rest):
    *dst_refs, bar_ref = rest
    i32 = ir.IntegerType.get_signless(32)
    i8 = ir.IntegerType.get_signless(8)
    index = ir.IndexType.get()
    c32 = lambda v: mgpu_utils.c(v, i32)
    # Private API: the descriptor that `async_copy` would make for this box.
    box = (1, SPANS, SPAN) if raw else (1, SPAN)
    desc = ctx._get_tma_desc(cache_ref, (), None, box, None if raw else SWIZZLE, None)
    warp = arith.remui(mgpu_utils.warp_idx(sync=True), c32(4))
    leader = mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.WARP)
    bar = mgpu_utils.memref_ptr(bar_ref)
    nvvm.mbarrier_arrive_expect_tx(bar, c32(ROWS_PER_WARP * DIM * 2), predicate=leader)
    bases = [mgpu_utils.memref_ptr(r) for r in dst_refs]
    for k in range(ROWS_PER_WARP):
      row = arith.addi(arith.muli(warp, c32(ROWS_PER_WARP)), c32(k))
      sid = memref.load(ids_ref, [arith.index_cast(index, row)])
      if raw:
        dst = mgpu_utils.getelementptr(bases[0], [arith.muli(row, c32(DIM * 2))], i8)
        nvvm.cp_async_bulk_tensor_shared_cluster_global(
            dst, desc, [c32(0), c32(0), sid], bar, [], predicate=leader)
        continue
      band, line = arith.divui(row, c32(8)), arith.remui(row, c32(8))
      per_band, bands = HALF // SPAN, TILE // 8  # a half's tiles across a band; bands
      for span in range(SPANS):
        if span < 2 * per_band:  # half h's span `sub`: tile (h * bands + band) * per_band + sub
          h, sub = divmod(span, per_band)
          tile_idx = arith.addi(arith.muli(band, c32(per_band)), c32(h * bands * per_band + sub))
          base = bases[0]
        else:  # the RoPE part: tile `band`
          tile_idx, base = band, bases[1]
        off = arith.addi(arith.muli(tile_idx, c32(TILE_BYTES)), arith.muli(line, c32(SWIZZLE)))
        dst = mgpu_utils.getelementptr(base, [off], i8)
        nvvm.cp_async_bulk_tensor_shared_cluster_global(
            dst, desc, [c32(span * SPAN), sid], bar, [], predicate=leader)

  _issue(*stage_refs)


def gather_kernel(ctas: int, tiles: int, num_rows: int, way: str):
  """Each CTA gathers its `tiles` tiles through a two-stage ring; returns its
  last two tiles as they landed (logical layout)."""
  assert tiles >= 2
  raw = way == "tma_rows"

  def body(ids_ref, cache_ref, *refs):
    if raw:
      out_raw, ids_smem, stage_raw, stage_idx, landed, id_bar = refs
    else:
      out_lat, out_rope, ids_smem, k_lat, k_rope, stage_idx, landed, id_bar = refs
    c = lax.axis_index("c")
    plgpu.copy_gmem_to_smem(ids_ref.at[c], ids_smem, id_bar)
    init_barriers(landed, arrivals=128 if way == "cp_async" else WARPS)
    plgpu.barrier_wait(id_bar)
    warpgroup_barrier()

    def issue(i, stage):
      if way == "cp_async":
        issue_gather(row_ids(ids_smem.at[i], tile=TILE), cache_ref, k_lat.at[stage],
                     k_rope.at[stage], ids_ref.at[c, i], stage_idx.at[stage],
                     landed.at[stage], tile=TILE, swizzle=SWIZZLE)
      elif raw:
        _tma_issue((ids_smem.at[i], cache_ref, stage_raw.at[stage], landed.at[stage]), way=way)
      else:
        _tma_issue((ids_smem.at[i], cache_ref, k_lat.at[stage], k_rope.at[stage],
                    landed.at[stage]), way=way)

    def wait(stage, use):  # the stage's `use`-th fill landed (parity use % 2)
      if isinstance(use, int):
        wait_barrier(landed.at[stage], parity=use % 2)
        return
      for ph in range(2):
        pl.when(use % 2 == ph)(functools.partial(wait_barrier, landed.at[stage], parity=ph))

    @pl.loop(0, tiles)
    def _(i):
      for stage in range(2):
        @pl.when(i % 2 == stage)
        def _():
          pl.when(i >= 2)(lambda: wait(stage, i // 2 - 1))
          issue(i, stage)

    for t in range(tiles - 2, tiles):
      stage = t % 2
      wait(stage, t // 2)
      slot = t - (tiles - 2)
      if raw:
        plgpu.copy_smem_to_gmem(stage_raw.at[stage], out_raw.at[c, slot])
      else:
        for h in range(2):  # (a TMA copy strides at most 5 dimensions)
          plgpu.copy_smem_to_gmem(k_lat.at[stage, h], out_lat.at[c, slot, h])
        plgpu.copy_smem_to_gmem(k_rope.at[stage], out_rope.at[c, slot])
    plgpu.wait_smem_to_gmem(0)

  tiled = bf16_tile(SWIZZLE)
  ids = plgpu.SMEM((tiles, TILE), jnp.int32)
  tail = [plgpu.SMEM((2, TILE), jnp.int32), plgpu.SMEM((2, 2), jnp.int32), plgpu.Barrier()]
  if raw:
    out_type = jax.ShapeDtypeStruct((ctas, 2, TILE, SPANS, SPAN), jnp.bfloat16)
    scratch = [ids, plgpu.SMEM((2, TILE, SPANS, SPAN), jnp.bfloat16), *tail]
  else:
    out_type = (jax.ShapeDtypeStruct((ctas, 2, 2, TILE, HALF), jnp.bfloat16),
                jax.ShapeDtypeStruct((ctas, 2, TILE, ROPE), jnp.bfloat16))
    scratch = [ids, plgpu.SMEM((2, 2, TILE, HALF), jnp.bfloat16, transforms=tiled),
               plgpu.SMEM((2, TILE, ROPE), jnp.bfloat16, transforms=tiled), *tail]
  kernel = plgpu.kernel(
      body, out_type=out_type, grid=(ctas,), grid_names=("c",), scratch_types=scratch,
      kernel_name=f"probe_gather_{way}")

  def run(ids, cache):
    return kernel(ids, cache.reshape(num_rows, SPANS, SPAN) if raw else cache)

  return run


def expected(ids, cache, tiles: int):
  """The last two tiles' rows as they should land: [ctas, 2, 64, 576]."""
  ids = ids[:, tiles - 2:]
  inside = (ids >= 0) & (ids < cache.shape[0])
  rows = jnp.where(inside[..., None], cache[jnp.where(inside, ids, 0)], 0)
  return np.asarray(rows.astype(jnp.float32))


def landed(way: str, out) -> np.ndarray:
  """A way's read-back as [ctas, 2, 64, 576] float32."""
  if way == "tma_rows":
    out = np.asarray(out.astype(jnp.float32))
    return out.reshape(*out.shape[:3], DIM)
  lat, rope = (np.asarray(o.astype(jnp.float32)) for o in out)
  return np.concatenate([lat[:, :, 0], lat[:, :, 1], rope], axis=-1)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--ctas", type=int, nargs="+", default=[132, 264])
  ap.add_argument("--tiles", type=int, default=32, help="tiles a CTA (2048 ids: 32)")
  ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
  ap.add_argument("--share", type=int, nargs="+", default=[1],
                  help="CTAs that gather the same ids side by side (2: as the two head "
                       "groups of a 128-head row do, the second read mostly from L2)")
  ap.add_argument("--rows", type=int, nargs="+", default=[8192 * 64, 16384],
                  help="rows of the cache: 8192 * 64 (604 MB) reads HBM, 16384 (19 MB) stays in L2")
  args = ap.parse_args(argv)
  key_c, key_i = jax.random.split(jax.random.key(0))
  table = []
  sms = num_sms()
  caches = {rows: jax.random.normal(key_c, (rows, DIM), jnp.bfloat16) for rows in args.rows}
  for rows, ctas, share in itertools.product(args.rows, args.ctas, args.share):
    cache = caches[rows]
    ids = jax.random.randint(key_i, (-(-ctas // share), args.tiles, TILE), 0, rows, jnp.int32)
    ids = jnp.repeat(ids, share, axis=0)[:ctas]
    # Ids outside the cache land zeros: -1, and one past the last row.
    ids = ids.at[:, -1, 3].set(-1).at[:, -2, 17].set(rows)
    want = expected(ids, cache, args.tiles)
    for way in args.ways:
      fn = jax.jit(gather_kernel(ctas, args.tiles, rows, way))
      got = landed(way, jax.block_until_ready(fn(ids, cache)))
      bad = int(np.sum(got != want))
      verdict = "landed right" if bad == 0 else f"{bad} WRONG elements"
      print(f"{way}, {rows} rows, {ctas} CTAs sharing by {share}: {verdict}", flush=True)
      if bad:
        return 1
      from jax.experimental.mosaic.gpu.profiler import measure

      _, times = measure(fn, aggregate=False, iterations=20)(ids, cache)
      per_call = sorted(sum(ms for k, ms in it if "probe_gather" in k) for it in times)
      us = per_call[len(per_call) // 2] * 1e3
      waves = -(-ctas // sms)
      tbps = ctas * args.tiles * TILE * DIM * 2 / us / 1e6
      table.append((way, rows, ctas, share, us, us / (args.tiles * waves), tbps))
  print(f"\n{jax.devices()[0].device_kind} ({sms} SMs), {args.tiles} tiles of 64 rows a CTA")
  head = ("way", "rows", "CTAs", "share", "µs", "µs a tile", "TB/s")
  print(f"{head[0]:<10} " + " ".join(f"{h:>{w}}" for h, w in zip(head[1:], (7, 5, 5, 8, 10, 6))))
  for way, rows, ctas, share, us, per_tile, tbps in table:
    print(f"{way:<10} {rows:>7} {ctas:>5} {share:>5} {us:>8.1f} {per_tile:>10.3f} {tbps:>6.2f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
