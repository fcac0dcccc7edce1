"""Tuning config of sparse MLA decode: how many splits of the top-k list per row."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

from jaxkv.kernels._common import (
    DEFAULT_SMS,
    IMPLEMENTATIONS,
    default_implementation,
    device_kind,
    load_tuning,
)
from jaxkv.kernels._common import num_sms as device_sms
from jaxkv.kernels.mla_decode.config import Q_REGS, check_choice
from jaxkv.kernels.sparse_mla_decode.stream import cut_boundaries

OP = "sparse_mla_decode"
MAX_SPLITS = 64
TILE = 64  # indices per kernel step; the kernel's tile is this one
COMBINES = ("kernel", "xla")
# Split counts whose CTAs can merge a row in the kernel, as one cluster
# (`SparseMLADecodeConfig.cluster_merge`): each CTA merges 512 / splits value
# channels, half per consumer warpgroup, and a cluster of more than 8 CTAs is
# not portable.
CLUSTER_SPLITS = (2, 4, 8)
MAX_PIECES = 32  # pieces of a cut row (`SparseMLADecodeConfig.pieces`)
# The most CTAs a launch in clusters of 4 or 8 ran in one wave on the H200
# (top-k 2048, 2026-12-04): 15 x 64 heads at 8 splits and 30 x 64 at 4 (120
# CTAs) did; 16 x 64 at 8 and 32 x 64 at 4 (128 CTAs) took two waves, 1.5-1.9x
# the time, since a cluster's CTAs must all fit on one GPC at once.
MAX_CLUSTER_CTAS = 120


@dataclasses.dataclass(frozen=True)
class SparseMLADecodeConfig:
  """Static launch parameters (hashable; a jit static argument).

  Attributes:
    num_splits: splits of each row's top-k list, one CTA each, merged by
      log-sum-exp afterwards; more fill the SMs at small batch, at the cost of
      one float32 partial output per split. `topk` must be a multiple of
      `64 * num_splits` (the kernel's tile).
    implementation: what a compiled (non-interpreted) call runs: "pallas"
      (the Mosaic GPU kernel; a Hopper GPU, compute capability 9.0: a
      `ValueError` names any other device) or "xla" (the jnp reference: any
      device, 2-3x slower on an H200). The default config is "xla" on other
      GPUs. Interpreted calls always run the kernel.
    q_regs: how many of the query's latent channels each consumer holds in
      registers for its QK, as in dense decode (`MLADecodeConfig.q_regs`;
      one of 0, 64, 128, 192). 128 measured fastest on the H200 (topk 2048,
      2026-12-01: 128 heads 165.1 -> 160.8 µs, 64 heads 94.6 -> 91.6, 64 x 64
      flat; 192 spills and is 6-21% slower; NOTES.md).
    stage_out: with one split and a bf16 result, the result goes out through
      SMEM by TMA (whole 64-byte rows) instead of from registers: 4-6% faster
      on the H200 at batch 128 (topk 2048, 2026-12-02: 128 heads 160.0 ->
      151.6 µs, 64 heads 91.9 -> 88.0; NOTES.md). The same for the bf16
      result of a merge in clusters (`cluster_merge`), each CTA's piece of
      it; a staged result holds the query's own heads, a multiple of 8
      (no XLA slice after the kernel).
    cut_rows: with one split, how many of the batch's last rows are cut
      into `pieces` contiguous pieces of their top-k list, a CTA each,
      merged by log-sum-exp afterwards, while the other rows keep one CTA per
      head group. None: `wave_plan`'s (a cost model of the CTAs' waves: where
      one CTA per row and head group overruns one wave, a few rows cut into
      many short pieces fill the SMs the whole rows leave, or more rows cut
      in halves make two even waves; with `cluster_merge=True`, halves that
      pair up alone); 0: none. On the H200 (top-k 2048), halves took 96 x
      128 heads from 145.4 to 127.1 µs and 150 x 64 from 153.9 to 140.8
      (2026-12-03); one row in 8 pieces took 67 x 128 from 119.1 (halves in
      clusters) to 95.4 and 133 x 64 from 129.8 to 103.6 (2026-12-04), and
      with the merge kernel in 16 pieces to 90.8 and 99.3 (NOTES.md).
    pieces: how many pieces a cut row is cut into (2 to 32, at most the
      list's 64-index tiles): None with `cut_rows=None`, `wave_plan`'s; None
      with `cut_rows` set, 2 (halves).
    cluster_merge: with several splits, whether a row's splits (2, 4 or 8)
      run as one cluster of CTAs that merge their partial results
      themselves, through L2 after a cluster barrier, instead of a combine
      kernel after the decode kernel. With one split and rows cut in halves
      (`cut_rows`, `pieces=2`), the same for each cut row's two halves (a cluster of
      two; the whole rows' CTAs are paired in clusters too, and merge
      nothing): it needs an even number of whole rows (`halves_pair_up`). None:
      `cluster_merge_pays`. On the H200 (top-k 2048, 2026-12-04) it took 14
      x 64 heads from 25.2 to 22.1 µs, 64 x 64 from 57.1 to 53.1 and 32 x 128
      from 53.2 to 48.5 (6-12% at 8-64 x 64 and 24-32 x 128), and twice as
      long where clusters of 4 or 8 CTAs need more than `MAX_CLUSTER_CTAS`
      SMs; the halves in clusters took 96 x 128 from 127.8 to 118.6 µs (its
      merge's result staged, `stage_out`) and 150 x 64 from 142.0 to 131.6
      (3-9% at nine shapes; NOTES.md).
    combine: what merges split or piece partials that no cluster merged:
      "kernel" (`piece_merge`, one Mosaic GPU kernel, cut rows merged into
      the decode kernel's result in place) or "xla" (`combine_splits`, two
      to four XLA kernels, and for cut rows an update of the result). On
      the H200 (top-k 2048, 2026-12-04) the kernel took 1.2-2.9 µs off a call
      (2 x 128 heads at 16 splits 17.4 -> 14.5 µs, 67 x 128 with one row in 8
      pieces 94.0 -> 92.8; NOTES.md).
    parts: with one split, run the batch as the stream schedule
      (`stream.py`): `parts` CTAs per head group, each over an equal run of
      the batch's top-k tiles laid end to end, a row cut between two runs
      merged afterwards (`piece_merge`). It needs `batch >= parts`. None:
      `wave_plan`'s choice; 0: never. Not with `cut_rows` or `cluster_merge`.
    f16_partials: the split or piece partials that a merge after the kernel
      reads (the combine kernel's or XLA's; not a cluster's, which stay
      float32) go out in float16, each head row's channel half divided by the
      least power of two at or above its largest finite value (so none
      overflows), staged through the last tile's stage and stored by TMA:
      half the partials' bytes written and read. The result differs from
      float32 partials' by at most a float16 rounding of each partial (2^-11
      relative), below the bf16 result's own. On by default: on the H200
      (top-k 2048, 2026-12-05) the stream took 83 x 128 heads from 115.3 to
      109.2 µs, 110 x 128 from 139.6 to 133.8, 140 x 128 from 174.0 to 167.8,
      200 x 128 from 238.4 to 231.8 and 270 x 64 from 191.6 to 187.4; 300 x 16
      and 2 x 128 (16 splits) within 1% (NOTES.md).
  """

  num_splits: int = 1
  implementation: str = "pallas"
  q_regs: int = 128
  stage_out: bool = True
  cut_rows: int | None = None
  pieces: int | None = None
  cluster_merge: bool | None = None
  combine: str = "kernel"
  parts: int | None = None
  f16_partials: bool = True

  def __post_init__(self):
    value = self.num_splits
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"num_splits={value!r} must be a positive int")
    if value > MAX_SPLITS:
      raise ValueError(f"{self.num_splits=} must be at most {MAX_SPLITS}")
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"{self.implementation=} must be one of {IMPLEMENTATIONS}")
    check_choice("q_regs", self.q_regs, Q_REGS)
    check_choice("combine", self.combine, COMBINES)
    if not isinstance(self.stage_out, bool):
      raise ValueError(f"{self.stage_out=} must be a bool")
    if not isinstance(self.f16_partials, bool):
      raise ValueError(f"{self.f16_partials=} must be a bool")
    rows = self.cut_rows
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 0):
      raise ValueError(f"cut_rows={rows!r} must be None or an int >= 0")
    if rows and self.num_splits != 1:
      raise ValueError(f"{self.cut_rows=} needs num_splits=1, got {self.num_splits=}")
    pieces = self.pieces
    if pieces is not None and (not isinstance(pieces, int) or isinstance(pieces, bool)
                               or not 2 <= pieces <= MAX_PIECES):
      raise ValueError(f"pieces={pieces!r} must be None or an int in [2, {MAX_PIECES}]")
    if self.cluster_merge not in (None, True, False):
      raise ValueError(f"cluster_merge={self.cluster_merge!r} must be None or a bool")
    if self.cluster_merge and self.num_splits not in (1, *CLUSTER_SPLITS):
      raise ValueError(
          f"{self.cluster_merge=} needs num_splits in {CLUSTER_SPLITS} (or 1, with rows cut"
          f" in halves), got {self.num_splits=}")
    parts = self.parts
    if parts is not None and (not isinstance(parts, int) or isinstance(parts, bool)
                              or parts == 1 or parts < 0):
      raise ValueError(f"parts={parts!r} must be None, 0 or an int >= 2")
    if parts and (self.num_splits != 1 or self.cut_rows or self.cluster_merge):
      raise ValueError(
          f"{self.parts=} needs num_splits=1 without cut_rows or cluster_merge, got"
          f" {self.num_splits=}, {self.cut_rows=}, {self.cluster_merge=}")
    if self.cluster_merge and self.num_splits == 1 and (self.cut_rows == 0
                                                         or self.pieces not in (None, 2)):
      raise ValueError(f"{self.cluster_merge=} with one split needs rows cut in halves,"
                       f" got {self.cut_rows=}, {self.pieces=}")


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
# cut rows (~131 rows in two pieces) took 8.8-10 µs.
STREAM_TILE_US = {1: 2.53, 2: 2.27}
STREAM_FIXED_US = {1: 19.9, 2: 8.3}
STREAM_MERGE_US = 9.0


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


def stream_cost(*, batch: int, num_heads: int, tiles: int, parts: int) -> float:
  """The stream schedule's modelled time (µs): its longest part (every CTA
  streams the whole time), plus the merge of the rows it cuts in two."""
  groups = min(-(-num_heads // 64), 2)
  span = STREAM_FIXED_US[groups] + -(-batch * tiles // parts) * STREAM_TILE_US[groups]
  return span + (STREAM_MERGE_US if cut_boundaries(batch=batch, tiles=tiles, parts=parts)
                 else 0.0)


@functools.lru_cache(maxsize=256)
def wave_plan(
    *, batch: int, num_heads: int, topk: int, num_splits: int, pieces: int | None = None,
    pairs_only: bool = False, stream: bool = True, num_sms: int = DEFAULT_SMS,
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
  per head group (`stream_cost`) where it beats that choice by `PLAN_MARGIN`
  too, at any batch past one wave. No cut with several splits, within one
  wave, past two waves (but the stream), and for a one-tile list.
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
    if stream_cost(batch=batch, num_heads=num_heads, tiles=tiles, parts=parts) < best_cost:
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
                   stream=config.parts is None, num_sms=device_sms())


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


def heuristic_config(
    *, batch: int, num_heads: int, topk: int, num_sms: int | None = None
) -> SparseMLADecodeConfig:
  """A config for any device: split until the grid covers the SMs once (None:
  the device's multiprocessors)."""
  if num_sms is None:
    num_sms = device_sms()
  ctas = batch * -(-num_heads // 64)
  splits = 1
  while ctas * splits * 2 <= num_sms and topk % (TILE * splits * 2) == 0:
    splits *= 2
  return SparseMLADecodeConfig(num_splits=min(splits, MAX_SPLITS),
                               implementation=default_implementation())


def config_from_entries(
    entries: list[dict[str, Any]], *, batch: int, num_heads: int, topk: int
) -> SparseMLADecodeConfig | None:
  """The first tuned entry whose batch range and `heads` match and whose splits divide topk.

  An entry matches `min_batch <= batch <= max_batch` (`min_batch` defaults to
  1, as in dense decode's entries) and `num_heads in heads`.
  """
  for entry in entries:
    if entry.get("min_batch", 1) <= batch <= entry["max_batch"] and num_heads in entry["heads"]:
      config = SparseMLADecodeConfig(**entry["config"])
      if topk % (TILE * config.num_splits) == 0:
        return config
  return None


def default_config(*, batch: int, num_heads: int, topk: int) -> SparseMLADecodeConfig:
  """The tuned config of this device where one matches, else the heuristic,
  which runs the jnp reference on a GPU that cannot run the kernels."""
  tuned = load_tuning(OP, device_kind())
  if tuned is not None:
    config = config_from_entries(
        tuned["entries"], batch=batch, num_heads=num_heads, topk=topk
    )
    if config is not None:
      return config
  return heuristic_config(batch=batch, num_heads=num_heads, topk=topk)
