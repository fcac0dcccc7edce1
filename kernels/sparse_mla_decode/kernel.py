"""Mosaic GPU body of sparse MLA decode: one CTA per (row, split, head group).

(With one split and `cut_rows`, the batch's last rows instead take
`pieces` CTAs per head group, one per contiguous piece of their top-k list,
after the whole rows' CTAs: a batch whose CTAs overrun one wave then ends on
short pieces. On the H200 at top-k 2048, halves took 96 × 128 heads from
145.4 to 127.1 µs and 150 × 64 from 153.9 to 140.8, merge included. With
`parts`, the stream schedule of `stream.py` instead: one CTA per head group
and equal share of the batch's tiles (whole rows of its own, then a run of
the other rows' tiles laid end to end), walking its rows segment by segment,
as dense decode's parts do.)

A row's keys are arbitrary cache slots. Warpgroup 2, the producer, gathers
each 64-row tile of them straight into the swizzled wgmma operand tiles of a
two-stage ring: compiled, each of its 128 threads copies its 16-byte pieces of
the rows with `cp.async` (`gather.py`: no TMA per row, no relayout through
registers), and arrives on the stage's own mbarrier with an arrival that
completes when its copies land (`cp.async.mbarrier.arrive.noinc`): the stage
is ready with its last byte, and the producer goes on to the next free stage
without waiting (so both stages can be filling at once when the consumers are
ahead of the copies).
Each tile's 64 slot ids come ahead of time by one TMA copy into a four-deep
SMEM ring. (The interpreter has no `cp.async`: there the producer issues one
TMA copy per row and latent half / RoPE part, which lands the same bytes, on
a Pallas barrier.)

Warpgroups 0 and 1 consume each tile as the dense kernel does
(`mla_decode.kernel`): scores by slots (warpgroup w computes S_w = Q K^T for
slots [32w, 32w + 32), 576 deep), values by channels (warpgroup w accumulates
O[:, 256w:256w+256] over all 64 slots), the halves met in the "seesaw" order
(`mla_decode.seesaw.seesaw_tile`: warpgroup 0's maximum is handed on; under
the 64-byte swizzle each multiplies its own P at once and the other's when it
arrives, under the 128-byte one, the default, the whole P once both are out).

Masking. Any slot of any tile can be invalid (-1, or any id outside the
cache: never clamped onto some other slot), so every tile is masked: each
stage's 64 indices land in SMEM with its rows, and the consumers give an
invalid index the score -inf in both modes. What the producer copies for
one differs: "select" zero-fills its row (`cp.async` with a source size of
0), so no slot outside the row's selection is ever read, and the row holds
zeros, weighted exactly 0, not what an earlier tile left there (another
row's slot, which may be NaN, under the stream; a staged result or
partial); "multiply" reads slot 0 (the null block) for the first invalid id
of each tile and zero-fills the others, so a non-finite null block meets
p = 0 in the accumulator (0 * NaN = NaN) and poisons the row exactly as in
production kernels, which read it for every -1 (once or many times, 0 * NaN
is NaN and 0 * finite adds +0), without every CTA of the step reading one
hot row.

The result (one split) or each split's partial result is stored to GMEM,
normalised, with its natural-log LSE; a split without a valid index writes
LSE = -inf and O = 0 (a partial: NaN if "multiply" accumulated a NaN value
row, which the merge never uses). A bf16 result goes out by TMA from the
last tile's stage (`stage_out`): from registers, two bf16 values per thread
and row fill half of each 32-byte sector a warp store touches, which cost the
kernel 4-5.5% at batch 128 on the H200. The f32 partials (two per thread and
row: whole sectors) are stored from registers; float16 partials
(`f16_partials`, scaled) go out through the last tile's stage like the
result.

With `cluster_merge`, a row's splits (n = 2, 4 or 8), or a cut row's two
halves (`cut_rows`, `pieces=2`; the whole rows' CTAs then go in pairs that merge
nothing), are one cluster of CTAs that merge their partials themselves
(`cluster.merge_row`), so that no combine kernel follows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.mla_decode.config import KV_SWIZZLES, Q_REGS, check_choice
from jaxkv.kernels.mla_decode.layout import (
    HALF,
    HEAD_TILE,
    LATENT,
    LOG2E,
    NUM_STAGES,
    ROPE,
    SLOT_HALF,
    bf16_tile,
    last_group_rows,
    launch,
    split_outputs,
)
from jaxkv.kernels.mla_decode.seesaw import seesaw_barriers, seesaw_p_scratch
from jaxkv.kernels.sparse_mla_decode.config import CLUSTER_SPLITS, TILE
from jaxkv.kernels.sparse_mla_decode.consumer import consume
from jaxkv.kernels.sparse_mla_decode.cta import IDX_STAGES, Launch, Smem, cta_work
from jaxkv.kernels.sparse_mla_decode.gather import FIRST_INVALID_SCRATCH
from jaxkv.kernels.sparse_mla_decode.plan import cluster_ctas
from jaxkv.kernels.sparse_mla_decode.producer import produce

# Slots per pipeline step (the config's divisibility unit): each consumer
# scores half.
assert TILE == 2 * SLOT_HALF
# Named regions of the in-kernel profile (see `build_kernel(profile_dir=)`).
REGIONS = (
    "query_wait", "kv_wait", "tile", "epilogue",  # consumers
    "qk", "handoff_wait", "pv",  # consumers, inside "tile" (`tile_regions`)
    "stage_wait", "issue", "query_free_wait",  # producer
    "ids_wait",  # producer, before "stage_wait" (`tile_regions`)
)
# Ranges per warpgroup the profiler records: this kernel leaves ~5 KB of SMEM
# free (3 x 16 B per range), about 40 tiles' two ranges a consumer.
PROFILE_RANGES = 96


def build_kernel(
    *,
    batch: int,
    heads_padded: int,
    topk: int,
    num_splits: int,
    sm_scale: float,
    select: bool,
    interpret,
    out_dtype=jnp.float32,
    q_regs: int = 0,
    kv_swizzle: int = 64,
    stage_out: bool = False,
    q_heads: int | None = None,
    cut_rows: int = 0,
    pieces: int = 2,
    cluster_merge: bool = False,
    parts: int = 0,
    stream_whole: int = 0,
    stream_segment: int = 0,
    f16_partials: bool = False,
    profile_dir: str | None = None,
    tile_regions: bool = False,
):
  """Builds the kernel call.

  Returns a function `(q, cache_rows, indices) -> (o, lse)` with q
  `[batch, heads_padded, 576]` bf16, cache_rows `[num_slots, 576]` bf16 (the
  cache with blocks and slots merged), indices `[batch, topk]` int32 (-1 or
  any id outside `[0, num_slots)`: masked; "multiply" reads slot 0 for the
  first of each tile). With several splits, o `[batch, num_splits,
  heads_padded, 512]` f32 and lse `[batch, num_splits, heads_padded]` f32
  are each split's partial result, for
  `combine_splits`. With one split they are the result itself, with no split
  axis: o `[batch, heads_padded, 512]` in `out_dtype` (0 where a row has no
  valid index) and lse `[batch, heads_padded]` f32.

  `q_regs`: the query's latent channels each consumer holds in registers for
  its QK, as in dense decode (`mla_decode.kernel.build_kernel`).

  `kv_swizzle`: the byte width of the swizzle of the query, the KV ring and
  the RoPE ring (64 or 128), as in dense decode: at 128 the gather writes
  64-column tiles and each consumer's PV takes a tile's whole P
  (`seesaw_pv_whole`, P from registers compiled), where at 64 each
  multiplies its own half first.

  `stage_out`: with one split and a bf16 result, each consumer writes its
  half of the result into its value half of the last tile's stage (free by
  then: both QKs and its own PV read it before) and stores it by TMA, in
  whole rows, instead of from registers (two bf16 per thread and
  row: 16 of a 32-byte sector per warp store). With `cluster_merge` and a
  bf16 result, the merged pieces go out the same way, through a buffer in
  the KV ring's bytes (a `RefUnion`: the ring is dead after the cluster's
  barrier).

  `q_heads`: the query's own heads (q `[batch, q_heads, 576]`), fewer than
  `heads_padded` and a multiple of 8, as in dense decode
  (`mla_decode.kernel.build_kernel`): the last head group's copies bring its
  real rows alone into the first rows of the query's tiles, whose other rows
  the producer zeroes before the copies. With `stage_out` the result then
  has `q_heads` rows too: the last head group stores its real rows alone by
  TMA (its LSE staged likewise). With several splits the last head group's
  partials are written for its real rows alone (`layout.store_head_rows`),
  the rows the combine reads. None: q is padded already.

  `cut_rows` (with one split): the batch's last `cut_rows` rows are cut
  into `pieces` contiguous pieces of their tiles (piece i: tiles
  `[i * n // pieces, (i + 1) * n // pieces)` of n), a CTA each, after the
  whole rows' CTAs in the grid, and their pieces' partial results go to two
  more outputs, o `[cut_rows, pieces, heads_padded, 512]` and lse
  `[cut_rows, pieces, heads_padded]` f32 (as several splits' are); the
  whole rows' results are the first two outputs, as with one split, whose
  last `cut_rows` rows are left unwritten. Where a batch's CTAs overrun one
  wave, the last one is then short pieces behind the whole rows instead of
  whole rows (`plan.wave_plan`).

  `cluster_merge` (with `num_splits` in `CLUSTER_SPLITS`): the splits of a
  row and head group are one cluster, which merges them in the kernel
  (module docstring). The first two outputs are then the result, o `[batch,
  out_heads, 512]` in `out_dtype` (each CTA stores its channels: staged, at
  the query's own heads, or from registers, in whole head groups, the last
  one's real rows alone) and lse `[batch, out_heads]` f32; two more, o
  `[batch, num_splits, heads_padded, 512]` and lse `[batch, num_splits,
  heads_padded]` f32, are the partials the cluster exchanged (without each
  CTA's own pieces), of no use to the caller. With `cut_rows` (halves: an even
  number of whole rows) the clusters are of two CTAs: two whole rows, which
  merge nothing, or a cut row's halves, which merge each other's partials
  (exchanged through the two extra outputs) and store the row's result;
  nothing is left unwritten.

  `parts` (with one split, no `cut_rows`, no `cluster_merge`, `2 <= parts
  <= batch`): the stream schedule (`stream.Stream`): `parts` CTAs per head
  group, each over `stream_whole` whole rows of its own (`stream_whole *
  parts <= batch`) and then an equal run of the other rows' tiles laid end
  to end, row segment by row segment (the query reloaded per segment; the
  KV ring runs on across segments; with `stream_segment` the leftover runs
  are cut by cost, a segment at that many tiles: `Stream.segment_cost`). A
  whole row's segment is the row's result, in the first two outputs (with
  `stage_out` staged in its last tile's stage, which goes back to the
  producer once the copy has read it);
  piece j of the i-th row cut between runs goes to two more outputs, o
  `[left_rows, max_pieces, heads_padded, 512]` and lse `[left_rows,
  max_pieces, heads_padded]` f32 (`Stream.left_rows` and
  `Stream.max_pieces`, at least 1 and 2), at `[i, j]`, for `piece_merge`.
  The cut rows of the first two outputs are left unwritten.

  `f16_partials` (where partials are merged after the kernel: several splits,
  `cut_rows` or `parts`, not `cluster_merge`): each consumer stores its half
  of a partial in float16, divided by a power of two per head row
  (`layout.scaled_half`: no finite value overflows), as bfloat16 bits
  staged through its value half of the partial's last tile's stage and
  stored by TMA, in whole rows (`layout.stage_head_group`); the stage is
  released once the copy has read it. The partials' outputs are then those
  of `layout.split_outputs(f16=True)`: O bf16 (float16 bits), LSE, and one
  more, the scales, f32 `[..., 2, heads_padded]` by channel half. (A later
  tile of the stage never reads those bits: an invalid id's row is
  zero-filled.)

  With `profile_dir` (compiled calls only), every call also writes a trace
  of the `REGIONS` each warpgroup of each CTA went through (Mosaic GPU's
  profiler, SM clock cycles; `benchmarks/profile_sparse_mla_decode.py`
  reads it), at most `PROFILE_RANGES` ranges per warpgroup: two per tile
  for each warpgroup, and with `tile_regions` three to five more for a
  consumer and one more for the producer (a CTA of ~40 tiles fits, ~15
  with `tile_regions`).
  """
  if profile_dir and interpret is not None:
    raise ValueError("profile_dir needs a compiled kernel (interpret=None)")
  assert topk % (TILE * num_splits) == 0
  assert cut_rows == 0 or (num_splits == 1 and 2 <= pieces <= topk // TILE
                           and cut_rows <= batch)
  assert not parts or (num_splits == 1 and not cut_rows and not cluster_merge
                       and 2 <= parts <= batch and 0 <= stream_whole * parts <= batch)
  assert not cluster_merge or (num_splits in CLUSTER_SPLITS and not cut_rows) or (
      num_splits == 1 and cut_rows and pieces == 2 and (batch - cut_rows) % 2 == 0)
  assert not f16_partials or (not cluster_merge and (parts or cut_rows or num_splits > 1))
  check_choice("q_regs", q_regs, Q_REGS)
  check_choice("kv_swizzle", kv_swizzle, KV_SWIZZLES)
  num_tiles = topk // (TILE * num_splits)  # per split, static
  dtype = jnp.bfloat16
  compiled = interpret is None
  bf16 = bf16_tile()  # P's tile (the RoPE query's, compiled)
  kv = bf16_tile(kv_swizzle)  # the query and the KV ring
  direct = num_splits == 1  # no merge: the kernel writes the result
  cluster_size = cluster_ctas(num_splits=num_splits, cut_rows=cut_rows,
                              cluster_merge=cluster_merge)
  merge_cols = HALF // cluster_size  # value channels each consumer merges
  staged = stage_out and out_dtype == jnp.bfloat16
  q_heads = heads_padded if q_heads is None else q_heads
  tail_heads = last_group_rows(q_heads, heads_padded)
  # The kernel's own result of a whole row, staged (in the stream, the last
  # tile's stage is released to the producer once the copy has read it: on
  # the H200 that took 110 x 128 heads from 143.8 to 138.5 µs against
  # registers, 140 x 128 178.4 -> 172.4, 300 x 16 204.2 -> 190.1); and the
  # result of a cluster's merge, staged.
  stage_out, stage_merged = staged and direct, staged and cluster_merge
  # Rows of the result: the real heads where the staged stores write them alone.
  out_heads = q_heads if stage_out or stage_merged else heads_padded
  lse_staged = tail_heads < HEAD_TILE and out_heads < heads_padded
  static = Launch(
      batch=batch, num_tiles=num_tiles, num_splits=num_splits, select=select,
      compiled=compiled, q_regs=q_regs, kv_swizzle=kv_swizzle,
      scale_log2=float(sm_scale) * LOG2E,
      out_dtype=out_dtype, head_groups=heads_padded // HEAD_TILE, tail_heads=tail_heads,
      cut_rows=cut_rows, pieces=pieces,
      cluster_merge=cluster_merge, cluster_size=cluster_size, parts=parts,
      stream_whole=stream_whole if parts else 0,
      stream_segment=stream_segment if parts else 0,
      stage_out=stage_out, stage_merged=stage_merged, f16_partials=f16_partials,
      tile_regions=tile_regions)

  def sparse_mla_decode_kernel(
      q_ref,  # [batch, q_heads, 576] bf16, GMEM
      cache_ref,  # [num_slots, 576] bf16, GMEM
      idx_ref,  # [batch, topk] int32, GMEM
      o_ref,  # [batch, (num_splits,) out_heads, 512], GMEM
      lse_ref,  # [batch, (num_splits,) out_heads] f32, GMEM
      *more_refs,  # cut_rows: [cut_rows, pieces, heads_padded, (512)] f32; cluster_merge:
      # [batch, num_splits, heads_padded, (512)] f32; parts: [left_rows,
      # max_pieces, heads_padded, (512)] f32; with f16_partials, the partials' scales
      # last (GMEM)
  ):
    cta = cta_work(static, num_slots=cache_ref.shape[0])

    def scoped(q_lat, k_lat, k_rope, p_smem, xchg, ids, stage_idx,
               q_bar, idx_bar, free_bar, sync_bar, q_free_bar,
               m0_bar, p0_bar, p1_bar, p0_free, p1_free, *extra_refs):
      # `cta.Smem` says what each is. extra_refs: compiled, landed and in
      # "multiply" scratch; interpreted, the RoPE query's buffer, ready_bar
      # and the P scratch; then as allocated below.
      # Compiled, the RoPE query lands in p_smem and moves to registers
      # before the first P is written (SMEM holds nothing more); the
      # interpreter keeps it in its own buffer.
      cluster_bar = lse_stage = merge_stage = None
      if cluster_merge and not compiled:
        *extra_refs, cluster_bar = extra_refs
      if lse_staged:
        *extra_refs, lse_stage = extra_refs
      if stage_merged and compiled:
        # [2, 64, 512 / cluster_size] bf16: each consumer's piece of the
        # merged result, in the KV ring's bytes (dead after the cluster's
        # barrier).
        k_lat, merge_stage = k_lat
      elif stage_merged:
        *extra_refs, merge_stage = extra_refs
      if compiled:
        landed, *rest = extra_refs
        scratch = rest[0] if rest else None
        q_rope_smem, ready_bar, p_scratch = p_smem, None, None
      else:
        q_rope_smem, ready_bar, p_scratch = extra_refs
        landed = scratch = None
      smem = Smem(
          q_lat=q_lat, k_lat=k_lat, k_rope=k_rope, p_smem=p_smem, xchg=xchg, ids=ids,
          stage_idx=stage_idx, q_bar=q_bar, idx_bar=idx_bar, free_bar=free_bar,
          sync_bar=sync_bar, q_free_bar=q_free_bar,
          bars=(m0_bar, p0_bar, p1_bar, p0_free, p1_free), landed=landed, scratch=scratch,
          q_rope_smem=q_rope_smem, ready_bar=ready_bar, p_scratch=p_scratch,
          lse_stage=lse_stage, merge_stage=merge_stage, cluster_bar=cluster_bar)
      wg = lax.axis_index("wg")
      pl.when(wg == 2)(lambda: produce(static, cta, smem, q_ref, cache_ref, idx_ref))
      for w in range(2):
        pl.when(wg == w)(lambda w=w: consume(w, static, cta, smem, o_ref, lse_ref, more_refs))

    ring = plgpu.SMEM((NUM_STAGES, 2, TILE, HALF), dtype, transforms=kv)  # k_lat
    if compiled:
      extra = [
          plgpu.SMEM((NUM_STAGES, 2), jnp.int32),
          *([] if select else [plgpu.SMEM((FIRST_INVALID_SCRATCH,), jnp.int32)]),
      ]
    else:
      # A stage is ready when the tile's 3 copies per row and its indices'
      # copy landed.
      extra = [
          plgpu.SMEM((HEAD_TILE, ROPE), dtype, transforms=kv),
          plgpu.Barrier(num_arrivals=3 * TILE + 1, num_barriers=NUM_STAGES),
          seesaw_p_scratch(),
      ]
    # Each consumer's piece of a cluster's merged result, staged for TMA.
    merge_stage = plgpu.SMEM((2, HEAD_TILE, merge_cols), dtype,
                             transforms=bf16_tile(min(128, 2 * merge_cols)))
    if stage_merged and not compiled:
      # (Its own buffer: the interpreter's race detector takes a `RefUnion` for
      # one buffer, whose writes and earlier reads it would report.)
      extra.append(merge_stage)
    if lse_staged:
      extra.append(plgpu.SMEM((HEAD_TILE,), jnp.float32))  # the last group's LSE
    if cluster_merge and not compiled:
      # The interpreter has no `barrier.cluster`: each consumer arrives on
      # every CTA's barrier of the cluster.
      extra.append(plgpu.ClusterBarrier(collective_axes=("s",), num_arrivals=2))
    pl.run_scoped(
        scoped,
        plgpu.SMEM((2, HEAD_TILE, HALF), dtype, transforms=kv),
        plgpu.RefUnion(ring, merge_stage) if stage_merged and compiled else ring,
        plgpu.SMEM((NUM_STAGES, TILE, ROPE), dtype, transforms=kv),
        plgpu.SMEM((HEAD_TILE, TILE), dtype, transforms=bf16),
        plgpu.SMEM((2, HEAD_TILE), jnp.float32),
        plgpu.SMEM((IDX_STAGES, TILE), jnp.int32),
        plgpu.SMEM((NUM_STAGES, TILE), jnp.int32),
        plgpu.Barrier(num_arrivals=3),
        plgpu.Barrier(num_arrivals=1, num_barriers=IDX_STAGES),
        plgpu.Barrier(num_arrivals=2, num_barriers=NUM_STAGES),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=2),
        *seesaw_barriers(),
        *extra,
        collective_axes="wg",
    )

  # No automatic barriers: each cross-thread hazard above is ordered by an
  # explicit commit_smem or an mbarrier.
  result = (jax.ShapeDtypeStruct((batch, out_heads, LATENT), out_dtype),
            jax.ShapeDtypeStruct((batch, out_heads), jnp.float32))
  f16 = dict(f16=f16_partials)
  if cluster_merge and not cut_rows:
    out_type = (*result, *split_outputs(batch, num_splits, heads_padded))
  elif parts:
    stream = static.stream
    out_type = (*result, *split_outputs(max(stream.left_rows, 1), max(stream.max_pieces, 2),
                                        heads_padded, **f16))
  elif direct:
    out_type = (*result,
                *(split_outputs(cut_rows, pieces, heads_padded, **f16) if cut_rows else ()))
  else:
    out_type = split_outputs(batch, num_splits, heads_padded, **f16)
  # With cluster_merge the splits (or two CTAs: two whole rows, or a cut
  # row's halves) are the cluster's axis, its CTAs side by side.
  rows = (batch + cut_rows) // 2 if cluster_merge and cut_rows else (
      parts or batch + (pieces - 1) * cut_rows)
  return launch(
      sparse_mla_decode_kernel,
      grid=(rows, *(() if cluster_merge else (num_splits,)), heads_padded // HEAD_TILE),
      grid_names=("b", *(() if cluster_merge else ("s",)), "g"),
      cluster=(cluster_size,) if cluster_merge else (),
      cluster_names=("s",) if cluster_merge else (),
      out_type=out_type,
      kernel_name="jaxkv_sparse_mla_decode",
      interpret=interpret,
      profile_dir=profile_dir,
      profile_ranges=PROFILE_RANGES,
  )
