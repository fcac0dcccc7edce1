"""The producer warpgroup of sparse MLA decode: the query, each tile's slot ids
and the gather of its rows into the KV ring (`kernel.py` says how)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.mla_decode.layout import (
    HALF,
    HEAD_TILE,
    LATENT,
    NUM_STAGES,
    ROPE,
    load_query,
    zero_query_rows,
)
from jaxkv.kernels.mla_decode.seesaw import region_scope
from jaxkv.kernels.sparse_mla_decode.cluster import cluster_sync
from jaxkv.kernels.sparse_mla_decode.config import TILE
from jaxkv.kernels.sparse_mla_decode.cta import (
    IDX_STAGES,
    PRODUCER_REGS,
    Cta,
    Launch,
    Smem,
    locate,
)
from jaxkv.kernels.sparse_mla_decode.gather import (
    init_barriers,
    issue_gather,
    null_first_invalid,
    row_ids,
    warpgroup_barrier,
)


def produce(launch: Launch, cta: Cta, smem: Smem, q_ref, cache_ref, idx_ref) -> None:
  """The producer's whole run: the query (per row segment with the stream),
  then the CTA's tiles, each into the next free stage of the ring.

  q_ref `[batch, q_heads, 576]` bf16, cache_ref `[num_slots, 576]` bf16 and
  idx_ref `[batch, topk]` int32 are GMEM.
  """
  compiled, select, parts = launch.compiled, launch.select, launch.parts
  cut_rows, num_tiles, n_steps = launch.cut_rows, launch.num_tiles, cta.n_steps
  q_lat, k_lat, k_rope, ids = smem.q_lat, smem.k_lat, smem.k_rope, smem.ids
  idx_bar, free_bar, q_free_bar, landed = smem.idx_bar, smem.free_bar, smem.q_free_bar, smem.landed
  if launch.tail_heads < HEAD_TILE:
    zero_query_rows(q_lat, smem.q_rope_smem)
  plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
  if compiled:
    # Before the query's copy: the consumers' wait on it orders their
    # first wait on a stage after this.
    init_barriers(landed, arrivals=128)
  query = functools.partial(load_query, q_ref, g=cta.g, head_groups=launch.head_groups,
                            tail_heads=launch.tail_heads, q_lat=q_lat, q_rope=smem.q_rope_smem,
                            bar=smem.q_bar)
  if parts:  # the part's first row: its first whole row, or its leftover run's first
    query(cta.runs[0 if launch.stream.whole else 1][0] // num_tiles)
  else:
    query(cta.b)

  def fetch_ids(j):
    row, tok = locate(launch, cta, j)
    ring = lax.rem(j, IDX_STAGES)
    plgpu.copy_gmem_to_smem(
        idx_ref.at[row, pl.ds(tok, TILE)],
        ids.at[ring],
        idx_bar.at[ring],
    )

  for t in range(IDX_STAGES if parts else min(IDX_STAGES, num_tiles)):
    if cut_rows or parts:
      pl.when(t < n_steps)(lambda t=t: fetch_ids(t))
    else:
      fetch_ids(t)
  # An invalid id's row is zero-filled by the gather (but in "multiply" the
  # first of a tile reads slot 0), weighted exactly 0: not a row an earlier
  # tile left there, which may be another row's NaN slot or a staged
  # result's or partial's bytes. Every row of a tile is written before it is
  # read, so the stages start as they are (the interpreter's start NaN).

  def gather(j, stage, tile_ids):
    # The tile's indices travel with its rows: the consumers mask by them.
    row, tok = locate(launch, cta, j)
    tile_idx = idx_ref.at[row, pl.ds(tok, TILE)]
    if compiled:
      issue_gather(
          tile_ids, cache_ref, k_lat.at[stage], k_rope.at[stage],
          tile_idx, smem.stage_idx.at[stage], landed.at[stage],
          tile=TILE, swizzle=launch.kv_swizzle,
      )
    else:
      ring = lax.rem(j, IDX_STAGES)
      plgpu.barrier_wait(idx_bar.at[ring])
      plgpu.copy_gmem_to_smem(tile_idx, smem.stage_idx.at[stage], smem.ready_bar.at[stage])
      _interpret_gather(ids.at[ring], cache_ref, k_lat.at[stage], k_rope.at[stage],
                        smem.ready_bar.at[stage], select=select, inside=cta.inside)

  # Compiled, a stage is ready when its copies landed (each producer
  # thread's arrival on `landed` completes with them), so the producer
  # moves on as soon as the next stage is free and both stages can be
  # filling at once; interpreted, the copies arrive on `ready_bar`.
  def produce_tile(i):  # the CTA's tile i, of any segment
    stage = lax.rem(i, NUM_STAGES)
    # Compiled, the producer loads the tile's ids into registers (and
    # in "multiply" points the first invalid id at the null block,
    # `null_first_invalid`) before it waits for the tile's stage: that
    # runs while the consumers still read the stage, and the copies go
    # out as soon as it comes free.
    tile_ids = None
    if compiled:
      ring = lax.rem(i, IDX_STAGES)
      with region_scope(launch.tile_regions)("ids_wait"):
        plgpu.barrier_wait(idx_bar.at[ring])
      tile_ids = row_ids(ids.at[ring], tile=TILE)
      if not select:
        tile_ids = null_first_invalid(tile_ids, smem.scratch, tile=TILE,
                                      num_rows=cta.num_slots)
    with jax.named_scope("stage_wait"):
      pl.when(i >= NUM_STAGES)(lambda: plgpu.barrier_wait(free_bar.at[stage]))
    with jax.named_scope("issue"):
      gather(i, stage, tile_ids)
    # Every thread's reads of the tile's ids before their refill (the
    # interpreter has no inline barrier: commit_smem is one too).
    (warpgroup_barrier if compiled else plgpu.commit_smem)()
    pl.when(i + IDX_STAGES < n_steps)(lambda: fetch_ids(i + IDX_STAGES))

  if parts:
    stream = launch.stream

    def produce_row(beg, end, row, carry):
      steps, segs = carry
      _, n = stream.segment(row, beg, end)

      @pl.when(segs > 0)
      def _():
        # The row's first tile goes out while the consumers finish the
        # last row's; its query, once both are done with that one.
        produce_tile(steps)
        with jax.named_scope("query_free_wait"):
          plgpu.barrier_wait(q_free_bar)
        query(row)

      pl.loop(jnp.minimum(segs, 1), n)(lambda i: produce_tile(steps + i))
      return steps + n, segs + 1

    carry = (jnp.int32(0), jnp.int32(0))
    for beg, end in cta.runs:  # the whole rows, then the leftover run
      carry = lax.fori_loop(*stream.run_rows(beg, end),
                            functools.partial(produce_row, beg, end), carry)
    plgpu.barrier_wait(q_free_bar)  # the last segment's release
  else:
    pl.loop(0, cta.n_tiles)(produce_tile)

  # Observe the releases of the last tiles too, so that every barrier
  # phase is consumed before the barriers go away.
  if cut_rows or parts:
    for k in range(NUM_STAGES):
      i = n_steps - NUM_STAGES + k
      pl.when(i >= 0)(lambda i=i: plgpu.barrier_wait(free_bar.at[lax.rem(i, NUM_STAGES)]))
  else:
    for i in range(max(num_tiles - NUM_STAGES, 0), num_tiles):
      plgpu.barrier_wait(free_bar.at[i % NUM_STAGES])
  if launch.cluster_merge and compiled:
    # Every thread of the cluster arrives (a cluster of whole rows
    # merges nothing and meets nowhere).
    if cut_rows:
      pl.when(~cta.whole)(cluster_sync)
    else:
      cluster_sync()


def _interpret_gather(tile_ids, cache_ref, k_lat, k_rope, ready_bar, *, select: bool, inside):
  """The interpreter's gather of a tile (it has no `cp.async`): one TMA copy
  per row and latent half / RoPE part, which lands the same bytes as
  `gather.issue_gather`, each arriving on `ready_bar`; a row copied from
  nowhere is stored zeros, as `issue_gather` zero-fills it, and arrives for
  its three copies.

  tile_ids `[64]` int32 SMEM (landed); k_lat `[2, 64, 256]` and k_rope
  `[64, 64]` bf16: the tile's stage.
  """
  if select:
    first = TILE
  else:  # the tile's first invalid id reads the null block
    col = lax.broadcasted_iota(jnp.int32, (TILE,), 0)
    first = jnp.min(jnp.where(inside(tile_ids[...]), TILE, col))

  @pl.loop(0, TILE)
  def _(r):
    sid = tile_ids[r]
    copy = inside(sid) | (r == first)

    @pl.when(copy)
    def _():
      src = cache_ref.at[pl.ds(jnp.where(inside(sid), sid, 0), 1)]
      for h in range(2):
        plgpu.copy_gmem_to_smem(
            src.at[:, pl.ds(h * HALF, HALF)],
            k_lat.at[h, pl.ds(r, 1)],
            ready_bar,
        )
      plgpu.copy_gmem_to_smem(
          src.at[:, pl.ds(LATENT, ROPE)],
          k_rope.at[pl.ds(r, 1)],
          ready_bar,
      )

    @pl.when(~copy)
    def _():
      for h in range(2):
        k_lat[h, pl.ds(r, 1), :] = jnp.zeros((1, HALF), k_lat.dtype)
      k_rope[pl.ds(r, 1), :] = jnp.zeros((1, ROPE), k_rope.dtype)
      for _ in range(3):  # the copies' arrivals
        plgpu.barrier_arrive(ready_bar)
