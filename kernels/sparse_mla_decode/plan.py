"""Sparse decode's launch plan: the rows a one-split call cuts into pieces or streams
(`wave_plan` and its cost model), and where a call's splits and pieces merge (in
the kernel's clusters, or after it)."""

from __future__ import annotations

import functools
from typing import NamedTuple

from jaxkv.kernels._common import DEFAULT_SMS
from jaxkv.kernels._common import num_sms as device_sms
from jaxkv.kernels.sparse_mla_decode.config import (
    MAX_CLUSTER_CTAS,
    TILE,
    SparseMLADecodeConfig,
)
from jaxkv.kernels.sparse_mla_decode.stream import Stream


class RowCut(NamedTuple):
  """Rows of a one-split call cut into pieces: the batch's last `rows` rows,
  `pieces` pieces each (none where `rows` is 0); or with `parts`, the
  stream schedule of `parts` CTAs per head group (`stream.py`; then `rows`
  is 0)."""

  rows: int
  pieces: int
  parts: int = 0


# The cost model of `wave_plan`, in µs on the H200 (top-k 2048, 2026-12-04:
# 32 tiles in ~75 µs per CTA under a full machine, 8.4 µs for a lone CTA of
# one tile; the merge kernel after the decode kernel 2.1-4.9 µs for 1 to 18
# cut rows in 4-32 pieces, 1-15 MB of partials: a launch, each CTA's work per
# piece, and the bytes. Fitted with one TMA copy per piece; 8 a copy, the
# default since, moved 4-16 pieces by 0.3 µs at most; NOTES.md).
TILE_US = 2.25  # a CTA's 64-index tile while every SM streams
CTA_US = 5.0  # a CTA's fixed cost: its query, its first gather, its epilogue
COMBINE_US = 1.2  # the merge kernel after the decode kernel, plus ...
COMBINE_PIECE_US = 0.09  # ... per piece of a row (each CTA sums them in turn) ...
COMBINE_MB_US = 0.17  # ... per MB of the partials it reads (mostly from L2)
# The piece counts `wave_plan` weighs. (Measured on the H200, 2026-12-04,
# µs end to end with the merge kernel: 16 pieces against 8 ran 89.8 / 93.3
# at 67 x 128 heads (one row cut), 98.6 / 101.9 at 133 x 64 and 96.1 / 96.3
# at 140 x 16 (eight rows), 95.9 / 95.5 at 70 x 128 (four rows); 32 pieces
# 90.5 and 98.6, no faster than 16.)
PLAN_PIECES = (2, 4, 8, 16)
LATENT_F32_BYTES = 512 * 4  # a partial's row
# A cut must beat no cut by this fraction in the model: in the band of 1.5-2
# waves its pieces ran ~10% slower than modelled (200 x 64: 4 pieces 176.3
# µs against no cut 155.9), where its gains are within ~1%.
PLAN_MARGIN = 0.05
# The stream schedule's cost (`stream_cost`), fitted on the H200 (top-k 2048,
# 2026-12-04, 13 shapes at 70-200 x 128 heads and 180-400 x 64: NOTES.md):
# per tile of the longest part and a fixed part (the first gather, 2-3 row
# segments each with its query and its store), by head groups: one group of
# 64 heads is bound by the gather's bandwidth when every SM streams, two
# share each row through L2. The fixed parts were fitted with whole rows'
# results stored from registers (12.8 and 21.8 µs) and lowered by what
# staging them saved (4.7-5.7 µs at 128 heads, 1.9 at 64). The merge of the
# cut rows: a launch, and per piece read or row written (each 64 heads x 512
# channels); with float16 pieces, 63 rows a head group cut in two at 83 x 128
# took 6.8-7.2 µs (2026-12-06).
STREAM_TILE_US = {1: 2.53, 2: 2.27}
STREAM_FIXED_US = {1: 19.9, 2: 8.3}
STREAM_MERGE_US = 1.5
STREAM_MERGE_TILE_US = 0.015
# Whole rows first in the stream (`stream_whole_pays`): at two head groups only
# where the leftover runs average this many tiles a part. On an H100
# (2026-12-06) one head group gained 1-9% at every shape; two were level at 3.9-10
# leftover tiles a part (83, 87, 140 x 128) and 1.3-2.5% slower at one (200 x 128).
STREAM_WHOLE_MIN_TILES = 4
# A row segment's own cost in tiles, by head groups, by which the stream
# cuts its leftover runs behind whole rows (`SparseMLADecodeConfig.
# stream_segment=None`; `stream.Stream.segment_cost`). An H100 profile at
# 83 x 128 (2026-12-06) put a segment at 10-14k cycles, 3-4 tiles. Timed on an
# H100 (2026-12-06, two runs, kernel µs against equal tiles): 83 x 128 heads
# 110.4 -> 107.8 and 109.8 -> 106.8 at 3 tiles (4: 108.2, 107.5), 75 x 128
# 100.4 -> 99.6 (4: 98.9), 150 x 64 in 132 parts 137.7 -> 136.2 (4: 136.1);
# in the plain layout (every row laid end to end) 140 x 128 went 167.1-167.2
# -> 168.5-168.7 (4: 168.2-168.9), so there the runs stay equal.
STREAM_SEGMENT_TILES = {1: 3, 2: 3}


def _span(whole: int, pieces: int, cta: float, piece: float, num_sms: int) -> float:
  """When the last of `whole` CTAs of cost `cta` (at most one wave, started
  first) and then `pieces` CTAs of cost `piece` ends, each CTA taking the SM
  that frees first. The SMs left free take pieces back to back from the start,
  the others from `cta` on, so the pieces end at the `pieces`-th smallest of
  those completion times: found by bisection on how many pieces are done by
  a time (the tests check it against a schedule of every CTA)."""
  end = cta if whole else 0.0
  if not pieces:
    return end
  free = num_sms - whole

  def done(t):  # pieces completed by time t
    return free * int(t // piece + 1e-9) + whole * max(0, int((t - cta) // piece + 1e-9))

  lo, hi = 0.0, cta + pieces * piece
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (lo, mid) if done(mid) >= pieces else (mid, hi)
  return max(end, hi)


def plan_cost(*, batch: int, num_heads: int, tiles: int, cut: RowCut,
              num_sms: int = DEFAULT_SMS) -> float:
  """`wave_plan`'s modelled time of a one-split call (µs): its CTAs' span,
  plus the combine of the cut rows unless they are halves that pair up
  (merged in the kernel's clusters)."""
  if cut.parts:
    return stream_cost(batch=batch, num_heads=num_heads, tiles=tiles, parts=cut.parts)
  groups = -(-num_heads // 64)
  cta = tiles * TILE_US + CTA_US
  if not cut.rows:
    return -(-batch * groups // num_sms) * cta
  whole = (batch - cut.rows) * groups
  if whole > num_sms:
    return float("inf")  # the whole rows overrun a wave: not a plan this model weighs
  piece = -(-tiles // cut.pieces) * TILE_US + CTA_US
  span = _span(whole, cut.rows * groups * cut.pieces, cta, piece, num_sms)
  if halves_pair_up(batch=batch, cut_rows=cut.rows, pieces=cut.pieces):
    return span
  partials_mb = cut.rows * cut.pieces * num_heads * LATENT_F32_BYTES / 1e6
  return span + COMBINE_US + COMBINE_PIECE_US * cut.pieces + COMBINE_MB_US * partials_mb


def stream_whole_pays(*, batch: int, num_heads: int, tiles: int, parts: int) -> bool:
  """Whether the stream gives each part its whole rows first
  (`SparseMLADecodeConfig.stream_whole=None`): at one head group always; at
  two where the leftover runs average `STREAM_WHOLE_MIN_TILES` tiles or more."""
  left = batch % parts * tiles  # the leftover rows' tiles
  return -(-num_heads // 64) == 1 or left >= STREAM_WHOLE_MIN_TILES * parts


def stream_whole_rows(whole: bool | None, *, batch: int, num_heads: int, tiles: int,
                      parts: int) -> int:
  """Whole rows per part (`stream.Stream.whole`) for `SparseMLADecodeConfig.stream_whole`."""
  if whole is None:
    whole = stream_whole_pays(batch=batch, num_heads=num_heads, tiles=tiles, parts=parts)
  return batch // parts if whole else 0


def stream_segment_tiles(segment: int | None, *, num_heads: int, whole_rows: int) -> int:
  """A row segment's cost in tiles (`stream.Stream.segment_cost`) for
  `SparseMLADecodeConfig.stream_segment`: None, `STREAM_SEGMENT_TILES` behind
  whole rows (`whole_rows`, `stream.Stream.whole`, > 0), else 0."""
  if segment is None:
    return STREAM_SEGMENT_TILES[min(-(-num_heads // 64), 2)] if whole_rows else 0
  return segment


def stream_schedule(whole: bool | None, segment: int | None, *, batch: int, num_heads: int,
                    tiles: int, parts: int) -> Stream:
  """The stream schedule of `SparseMLADecodeConfig.stream_whole` and
  `stream_segment` (None: the plan's rules) at this shape."""
  whole_rows = stream_whole_rows(whole, batch=batch, num_heads=num_heads, tiles=tiles,
                                 parts=parts)
  return Stream(batch, tiles, parts, whole_rows,
                stream_segment_tiles(segment, num_heads=num_heads, whole_rows=whole_rows))


def stream_cost(*, batch: int, num_heads: int, tiles: int, parts: int,
                whole: bool | None = None, segment: int | None = None) -> float:
  """The stream schedule's modelled time (µs): its longest part (every CTA
  streams the whole time), plus the merge of the rows it cuts (`whole` and
  `segment`: `SparseMLADecodeConfig.stream_whole` and `stream_segment`; the
  span counts the tiles of an equal cut, fitted before the cut by cost)."""
  groups = min(-(-num_heads // 64), 2)
  span = STREAM_FIXED_US[groups] + -(-batch * tiles // parts) * STREAM_TILE_US[groups]
  stream = stream_schedule(whole, segment, batch=batch, num_heads=num_heads, tiles=tiles,
                           parts=parts)
  if not stream.cut_rows:
    return span
  tiles_moved = (stream.cut_pieces + stream.cut_rows) * -(-num_heads // 64)
  return span + STREAM_MERGE_US + STREAM_MERGE_TILE_US * tiles_moved


@functools.lru_cache(maxsize=256)
def wave_plan(
    *, batch: int, num_heads: int, topk: int, num_splits: int, pieces: int | None = None,
    pairs_only: bool = False, stream: bool = True, num_sms: int = DEFAULT_SMS,
    stream_whole: bool | None = None, stream_segment: int | None = None,
) -> RowCut:
  """The rows to cut and their pieces (`SparseMLADecodeConfig.cut_rows=None`).

  One split gives each row and head group one CTA of the whole top-k list.
  Where those CTAs overrun one wave (up to two), the last wave would be a
  few whole rows behind all the others. This cuts the batch's last rows into
  pieces so that the SMs the whole rows leave free, and all of them after,
  take short pieces instead: the count of rows and of pieces (`PLAN_PIECES`,
  or `pieces` alone; with `pairs_only`, halves that pair up alone) that
  `plan_cost`'s model of the waves ends soonest, cutting nothing where no cut
  beats the whole rows' waves by `PLAN_MARGIN`. With `stream` (and neither
  `pieces` nor `pairs_only`), the stream schedule of `num_sms / groups` CTAs
  per head group (`stream_cost`, with `stream_whole` and `stream_segment`)
  where it beats that choice by `PLAN_MARGIN` too, at any batch past one
  wave. No cut with several splits, within one wave, past two waves (but
  the stream), and for a one-tile list.
  """
  tiles = topk // TILE
  none = RowCut(0, 2)
  groups = -(-num_heads // 64)
  if num_splits != 1 or tiles < 2 or batch * groups <= num_sms:
    return none
  choices = [p for p in ((2,) if pairs_only else (pieces,) if pieces else PLAN_PIECES)
             if p <= tiles]
  if batch * groups > 2 * num_sms:
    choices = []
  best, best_cost = none, plan_cost(batch=batch, num_heads=num_heads, tiles=tiles, cut=none,
                                    num_sms=num_sms) * (1 - PLAN_MARGIN)
  for n in choices:
    for rows in range(max(1, batch - num_sms // groups), batch + 1):
      cut = RowCut(rows, n)
      if pairs_only and not halves_pair_up(batch=batch, cut_rows=rows, pieces=n):
        continue
      cost = plan_cost(batch=batch, num_heads=num_heads, tiles=tiles, cut=cut,
                       num_sms=num_sms)
      if cost < best_cost - 1e-6:
        best, best_cost = cut, cost
  parts = num_sms // groups
  if stream and not pieces and not pairs_only and parts >= 2:
    # It too must beat the plan chosen so far by `PLAN_MARGIN` in the model.
    if best.rows:
      best_cost *= 1 - PLAN_MARGIN
    if stream_cost(batch=batch, num_heads=num_heads, tiles=tiles, parts=parts,
                   whole=stream_whole, segment=stream_segment) < best_cost:
      best = RowCut(0, 2, parts)
  return best


def rows_to_cut(config: SparseMLADecodeConfig, *, batch: int, num_heads: int,
                topk: int) -> RowCut:
  """`config.cut_rows` and `config.pieces` (2 where None), or where `cut_rows`
  is None, `wave_plan` for this shape (for `config.pieces` alone if set; for
  halves that pair up alone with `cluster_merge=True`, which merges them).
  With `config.parts` set, that stream schedule (no rows cut into pieces)."""
  if config.parts:
    return RowCut(0, 2, config.parts)
  if config.cut_rows is not None:
    return RowCut(config.cut_rows, config.pieces or 2)
  return wave_plan(batch=batch, num_heads=num_heads, topk=topk,
                   num_splits=config.num_splits, pieces=config.pieces,
                   pairs_only=bool(config.cluster_merge) and config.pieces in (None, 2),
                   stream=config.parts is None, num_sms=device_sms(),
                   stream_whole=config.stream_whole, stream_segment=config.stream_segment)


def halves_pair_up(*, batch: int, cut_rows: int, pieces: int = 2) -> bool:
  """Whether rows cut in halves can merge them in clusters of two CTAs: the
  whole rows' CTAs pair up (an even count of them)."""
  return cut_rows > 0 and pieces == 2 and (batch - cut_rows) % 2 == 0


def cluster_ctas(*, num_splits: int, cut_rows: int, cluster_merge: bool) -> int:
  """CTAs per cluster of a launch: with `cluster_merge`, a row's splits, or
  with rows cut in halves two (two whole rows, or a cut row's halves); else 1."""
  if not cluster_merge:
    return 1
  return 2 if cut_rows else num_splits


def cluster_merge_pays(*, batch: int, num_heads: int, num_splits: int,
                       cut_rows: int = 0, pieces: int = 2) -> bool:
  """Whether a row's splits merge in the kernel's clusters
  (`SparseMLADecodeConfig.cluster_merge=None`): at 2 splits, and at 4 or 8
  where the launch's CTAs stay within `MAX_CLUSTER_CTAS` (clusters of 2 ran
  128 CTAs in one wave on the H200); with one split, the halves of cut rows
  wherever `halves_pair_up`."""
  if num_splits == 1:
    return halves_pair_up(batch=batch, cut_rows=cut_rows, pieces=pieces)
  ctas = batch * -(-num_heads // 64) * num_splits
  return num_splits == 2 or (num_splits in (4, 8) and ctas <= MAX_CLUSTER_CTAS)


def merges_in_cluster(config: SparseMLADecodeConfig, *, batch: int, num_heads: int,
                      cut: RowCut = RowCut(0, 2)) -> bool:
  """`config.cluster_merge`, or where it is None, `cluster_merge_pays` for this shape.

  `cut`: the rows this call cuts (`rows_to_cut`). Raises ValueError where
  `cluster_merge=True` asks for halves that cannot pair up.
  """
  if config.num_splits == 1 and config.cluster_merge:
    if not halves_pair_up(batch=batch, cut_rows=cut.rows, pieces=cut.pieces):
      raise ValueError(
          f"{config.cluster_merge=} with one split needs rows cut in halves beside an even"
          f" number of whole rows: got batch={batch}, cut_rows={cut.rows},"
          f" pieces={cut.pieces}")
  if config.cluster_merge is not None:
    return config.cluster_merge
  return cluster_merge_pays(batch=batch, num_heads=num_heads, num_splits=config.num_splits,
                            cut_rows=cut.rows, pieces=cut.pieces)


def merged_after_kernel(config: SparseMLADecodeConfig, *, cut: RowCut, in_clusters: bool) -> bool:
  """Whether a call leaves partials to a merge after the kernel (the combine
  kernel's or XLA's): several splits, cut rows or the stream, not merged in
  clusters (`in_clusters`: `merges_in_cluster`'s answer). `f16_partials`
  applies there alone."""
  return not in_clusters and (config.num_splits > 1 or bool(cut.rows) or bool(cut.parts))
