"""Tuning config of sparse MLA decode: how many splits of the top-k list per row."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxkv.kernels._common import (
    IMPLEMENTATIONS,
    default_implementation,
    device_kind,
    load_tuning,
)
from jaxkv.kernels._common import num_sms as device_sms
from jaxkv.kernels.mla_decode.config import KV_SWIZZLES, Q_REGS, check_choice

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
MAX_STREAM_SEGMENT = 32  # a row segment's cost in tiles (`SparseMLADecodeConfig.stream_segment`)
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
      SMEM by TMA (whole rows) instead of from registers: 4-6% faster
      on the H200 at batch 128 (topk 2048, 2026-12-02: 128 heads 160.0 ->
      151.6 µs, 64 heads 91.9 -> 88.0; NOTES.md). The same for the bf16
      result of a merge in clusters (`cluster_merge`), each CTA's piece of
      it; a staged result holds the query's own heads, a multiple of 8
      (no XLA slice after the kernel).
    cut_rows: with one split, how many of the batch's last rows are cut
      into `pieces` contiguous pieces of their top-k list, a CTA each,
      merged by log-sum-exp afterwards, while the other rows keep one CTA per
      head group. None: `plan.wave_plan`'s (a cost model of the CTAs' waves: where
      one CTA per row and head group overruns one wave, a few rows cut into
      many short pieces fill the SMs the whole rows leave, or more rows cut
      in halves make two even waves; with `cluster_merge=True`, halves that
      pair up alone); 0: none. On the H200 (top-k 2048), halves took 96 x
      128 heads from 145.4 to 127.1 µs and 150 x 64 from 153.9 to 140.8
      (2026-12-03); one row in 8 pieces took 67 x 128 from 119.1 (halves in
      clusters) to 95.4 and 133 x 64 from 129.8 to 103.6 (2026-12-04), and
      with the merge kernel in 16 pieces to 90.8 and 99.3 (NOTES.md).
    pieces: how many pieces a cut row is cut into (2 to 32, at most the
      list's 64-index tiles): None with `cut_rows=None`, `plan.wave_plan`'s; None
      with `cut_rows` set, 2 (halves).
    cluster_merge: with several splits, whether a row's splits (2, 4 or 8)
      run as one cluster of CTAs that merge their partial results
      themselves, through L2 after a cluster barrier, instead of a combine
      kernel after the decode kernel. With one split and rows cut in halves
      (`cut_rows`, `pieces=2`), the same for each cut row's two halves (a cluster of
      two; the whole rows' CTAs are paired in clusters too, and merge
      nothing): it needs an even number of whole rows (`plan.halves_pair_up`). None:
      `plan.cluster_merge_pays`. On the H200 (top-k 2048, 2026-12-04) it took 14
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
      (`stream.py`): `parts` CTAs per head group, each over an equal share
      of the batch's top-k tiles (its own whole rows first, with
      `stream_whole`, then a run of the others' tiles laid end to end), a
      row cut between runs merged afterwards (`piece_merge`). It needs
      `batch >= parts`. None: `plan.wave_plan`'s choice; 0: never. Not with
      `cut_rows` or `cluster_merge`.
    stream_whole: with the stream, each part first takes `batch // parts`
      whole rows of its own, and only the other rows' tiles are laid end to
      end in equal runs behind them (`stream.Stream`): the same tiles a
      part, but far fewer rows cut, in more pieces (83 x 128 heads: 17 rows
      a head group in 4-5 pieces, against 63 in two), so the merge after
      the kernel reads and writes about half the bytes. False: every row's
      tiles laid end to end. None: `plan.stream_whole_pays` (one head group
      always; two where the leftover runs average 4 tiles or more). On an
      H100 (top-k 2048, 2026-12-06) it took 270 x 64 heads from 252 to 242
      µs, 400 x 64 from 361 to 346 and 180 x 64 from 175 to 168; at 128
      heads 83 x 128 0.98-1.01 of the plain layout's time over three runs,
      140 x 128 0.99-1.01, and 200 x 128 (one-tile pieces) 1.013-1.025
      (NOTES.md).
    stream_segment: with the stream, the cost of a row segment of a part
      (its query, row sums, finish and store) in tiles, by which the
      leftover runs are cut (`stream.Stream.segment_cost`): a run that
      crosses a row's edge takes that many fewer tiles, capped so that each
      run keeps one at least. 0: equal tiles a part. None:
      `plan.STREAM_SEGMENT_TILES` (3) behind whole rows, 0 in the plain
      layout. An H100 profile at 83 x 128 heads (top-k 2048, 2026-12-06) put
      a segment at 3-4 tiles. On an H100 (2026-12-06, two runs) 3 took the
      decode kernel at 83 x 128 from 110.4 to 107.8 µs and from 109.8 to
      106.8, 75 x 128 from 100.4 to 99.6 and 150 x 64 in 132 parts from 137.7
      to 136.2; in the plain layout 140 x 128 went from 167.1 to 168.5
      (NOTES.md). On the H200 (2026-12-06, end to end against equal tiles,
      one run) 83 x 128 went from 108.9 to 107.6 µs and 75 x 128 from 100.2
      to 98.0, and 110 x 128 from 132.2 to 134.4 (NOTES.md).
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
    kv_swizzle: the byte width of the swizzle of the query and the KV ring
      in SMEM, as in dense decode (`MLADecodeConfig.kv_swizzle`; 64 or
      128): at 64, 32-column tiles, and each consumer multiplies its own
      half of a tile's P into its values beside the other's softmax; at
      128, 64-column tiles, and each consumer's PV takes the whole P of a
      tile at once. 128 was never slower on an H100 past the spread (top-k
      2048, 2026-12-06, 21 shapes: 0.93-1.00 of 64's time, 90 x 128 level;
      83 x 128 heads 117.2 -> 113.3 µs, 128 x 64 115.6 -> 110.9, 128 x 16
      110.3 -> 106.8, 4 x 128 17.1 -> 16.0), nor on the H200 (83 x 128
      108.9 -> 107.8, 128 x 64 84.0 -> 81.9, 128 x 128 level; NOTES.md).
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
  stream_whole: bool | None = None
  stream_segment: int | None = None
  f16_partials: bool = True
  kv_swizzle: int = 128

  def __post_init__(self):
    value = self.num_splits
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"num_splits={value!r} must be a positive int")
    if value > MAX_SPLITS:
      raise ValueError(f"{self.num_splits=} must be at most {MAX_SPLITS}")
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"{self.implementation=} must be one of {IMPLEMENTATIONS}")
    check_choice("q_regs", self.q_regs, Q_REGS)
    check_choice("kv_swizzle", self.kv_swizzle, KV_SWIZZLES)
    check_choice("combine", self.combine, COMBINES)
    if not isinstance(self.stage_out, bool):
      raise ValueError(f"{self.stage_out=} must be a bool")
    if not isinstance(self.f16_partials, bool):
      raise ValueError(f"{self.f16_partials=} must be a bool")
    if not (self.stream_whole is None or isinstance(self.stream_whole, bool)):
      raise ValueError(f"stream_whole={self.stream_whole!r} must be None or a bool")
    segment = self.stream_segment
    if segment is not None and (not isinstance(segment, int) or isinstance(segment, bool)
                                or not 0 <= segment <= MAX_STREAM_SEGMENT):
      raise ValueError(f"stream_segment={segment!r} must be None or an int in"
                       f" [0, {MAX_STREAM_SEGMENT}]")
    rows = self.cut_rows
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 0):
      raise ValueError(f"cut_rows={rows!r} must be None or an int >= 0")
    if rows and self.num_splits != 1:
      raise ValueError(f"{self.cut_rows=} needs num_splits=1, got {self.num_splits=}")
    pieces = self.pieces
    if pieces is not None and (not isinstance(pieces, int) or isinstance(pieces, bool)
                               or not 2 <= pieces <= MAX_PIECES):
      raise ValueError(f"pieces={pieces!r} must be None or an int in [2, {MAX_PIECES}]")
    if self.cluster_merge is not None and not isinstance(self.cluster_merge, bool):
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
