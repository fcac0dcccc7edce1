"""Tuning config of sparse MLA decode: how many splits of the top-k list per row."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxkv.kernels._common import device_kind, load_tuning
from jaxkv.kernels.mla_decode.config import Q_REGS, check_choice

OP = "sparse_mla_decode"
MAX_SPLITS = 64
TILE = 64  # indices per kernel step; the kernel's tile is this one
IMPLEMENTATIONS = ("xla", "pallas")
# Split counts whose CTAs can merge a row in the kernel, as one cluster
# (`SparseMLADecodeConfig.cluster_merge`): each CTA merges 512 / splits value
# channels, half per consumer warpgroup, and a cluster of more than 8 CTAs is
# not portable.
CLUSTER_SPLITS = (2, 4, 8)
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
      (the Mosaic GPU kernel, the default; needs a Hopper GPU) or "xla" (the
      jnp reference: any device, 2-3x slower on an H200). Interpreted calls
      always run the kernel.
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
    half_rows: with one split, how many of the batch's last rows are cut in
      two halves of their top-k list, a CTA each, merged by log-sum-exp
      afterwards, while the other rows keep one CTA per head group. None:
      `wave_fill_rows` (enough that the CTAs make two whole waves where one
      CTA per row and head group overruns one wave by at most half of one);
      0: none. On the H200 (top-k 2048, 2026-12-03) the automatic count took
      96 x 128 heads from 145.4 to 127.1 µs and 150 x 64 from 153.9 to 140.8
      (NOTES.md).
    cluster_merge: with several splits, whether a row's splits (2, 4 or 8)
      run as one cluster of CTAs that merge their partial results
      themselves, through L2 after a cluster barrier, instead of a combine
      kernel after the decode kernel. With one split and rows cut in halves
      (`half_rows`), the same for each cut row's two halves (a cluster of
      two; the whole rows' CTAs are paired in clusters too, and merge
      nothing): it needs an even number of whole rows (`halves_pair_up`). None:
      `cluster_merge_pays`. On the H200 (top-k 2048, 2026-12-04) it took 14
      x 64 heads from 25.2 to 22.1 µs, 64 x 64 from 57.1 to 53.1 and 32 x 128
      from 53.2 to 48.5 (6-12% at 8-64 x 64 and 24-32 x 128), and twice as
      long where clusters of 4 or 8 CTAs need more than `MAX_CLUSTER_CTAS`
      SMs; the halves in clusters took 96 x 128 from 127.8 to 118.6 µs (its
      merge's result staged, `stage_out`) and 150 x 64 from 142.0 to 131.6
      (3-9% at nine shapes; NOTES.md).
  """

  num_splits: int = 1
  implementation: str = "pallas"
  q_regs: int = 128
  stage_out: bool = True
  half_rows: int | None = None
  cluster_merge: bool | None = None

  def __post_init__(self):
    value = self.num_splits
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"num_splits={value!r} must be a positive int")
    if value > MAX_SPLITS:
      raise ValueError(f"{self.num_splits=} must be at most {MAX_SPLITS}")
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"{self.implementation=} must be one of {IMPLEMENTATIONS}")
    check_choice("q_regs", self.q_regs, Q_REGS)
    if not isinstance(self.stage_out, bool):
      raise ValueError(f"{self.stage_out=} must be a bool")
    rows = self.half_rows
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 0):
      raise ValueError(f"half_rows={rows!r} must be None or an int >= 0")
    if rows and self.num_splits != 1:
      raise ValueError(f"{self.half_rows=} needs num_splits=1, got {self.num_splits=}")
    if self.cluster_merge not in (None, True, False):
      raise ValueError(f"cluster_merge={self.cluster_merge!r} must be None or a bool")
    if self.cluster_merge and self.num_splits not in (1, *CLUSTER_SPLITS):
      raise ValueError(
          f"{self.cluster_merge=} needs num_splits in {CLUSTER_SPLITS} (or 1, with rows cut"
          f" in halves), got {self.num_splits=}")
    if self.cluster_merge and self.num_splits == 1 and self.half_rows == 0:
      raise ValueError(f"{self.cluster_merge=} with one split needs rows cut in halves,"
                       f" got {self.half_rows=}")


def wave_fill_rows(
    *, batch: int, num_heads: int, topk: int, num_splits: int, num_sms: int = 132
) -> int:
  """Rows to cut in halves (`SparseMLADecodeConfig.half_rows=None`).

  One split gives each row and head group one CTA of the whole top-k list.
  Where those CTAs overrun one wave by at most half of one (a CTA per SM),
  the second wave would be a few whole rows behind all the others: cutting
  the last rows in halves until the CTAs make two waves puts short halves
  there instead, behind whole rows (or, past half a wave, two whole rows
  would share an SM anyway). 0 elsewhere, with several splits, and for a
  one-tile top-k list.
  """
  if num_splits != 1 or topk // TILE < 2:
    return 0
  groups = -(-num_heads // 64)
  if not num_sms < batch * groups <= 3 * num_sms // 2:
    return 0
  return min(batch, 2 * num_sms // groups - batch)


def rows_to_cut(config: SparseMLADecodeConfig, *, batch: int, num_heads: int, topk: int) -> int:
  """`config.half_rows`, or where it is None, `wave_fill_rows` for this shape."""
  if config.half_rows is not None:
    return config.half_rows
  return wave_fill_rows(batch=batch, num_heads=num_heads, topk=topk,
                        num_splits=config.num_splits)


def halves_pair_up(*, batch: int, half_rows: int) -> bool:
  """Whether rows cut in halves can merge them in clusters of two CTAs: the
  whole rows' CTAs pair up (an even count of them; always so for
  `wave_fill_rows`)."""
  return half_rows > 0 and (batch - half_rows) % 2 == 0


def cluster_ctas(*, num_splits: int, half_rows: int, cluster_merge: bool) -> int:
  """CTAs per cluster of a launch: with `cluster_merge`, a row's splits, or
  with rows cut in halves two (two whole rows, or a cut row's halves); else 1."""
  if not cluster_merge:
    return 1
  return 2 if half_rows else num_splits


def cluster_merge_pays(*, batch: int, num_heads: int, num_splits: int,
                       half_rows: int = 0) -> bool:
  """Whether a row's splits merge in the kernel's clusters
  (`SparseMLADecodeConfig.cluster_merge=None`): at 2 splits, and at 4 or 8
  where the launch's CTAs stay within `MAX_CLUSTER_CTAS` (clusters of 2 ran
  128 CTAs in one wave on the H200); with one split, the halves of cut rows
  wherever `halves_pair_up`."""
  if num_splits == 1:
    return halves_pair_up(batch=batch, half_rows=half_rows)
  ctas = batch * -(-num_heads // 64) * num_splits
  return num_splits == 2 or (num_splits in (4, 8) and ctas <= MAX_CLUSTER_CTAS)


def merges_in_cluster(config: SparseMLADecodeConfig, *, batch: int, num_heads: int,
                      half_rows: int = 0) -> bool:
  """`config.cluster_merge`, or where it is None, `cluster_merge_pays` for this shape.

  `half_rows`: the rows this call cuts in halves (`rows_to_cut`). Raises
  ValueError where `cluster_merge=True` asks for halves that cannot pair up.
  """
  if config.num_splits == 1 and config.cluster_merge:
    if not halves_pair_up(batch=batch, half_rows=half_rows):
      raise ValueError(
          f"{config.cluster_merge=} with one split needs rows cut in halves beside an even"
          f" number of whole rows: got batch={batch}, half_rows={half_rows}")
  if config.cluster_merge is not None:
    return config.cluster_merge
  return cluster_merge_pays(batch=batch, num_heads=num_heads, num_splits=config.num_splits,
                            half_rows=half_rows)


def heuristic_config(
    *, batch: int, num_heads: int, topk: int, num_sms: int = 132
) -> SparseMLADecodeConfig:
  """A config for any device: split until the grid covers the SMs once."""
  ctas = batch * -(-num_heads // 64)
  splits = 1
  while ctas * splits * 2 <= num_sms and topk % (TILE * splits * 2) == 0:
    splits *= 2
  return SparseMLADecodeConfig(num_splits=min(splits, MAX_SPLITS))


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
  """The tuned config of this device where one matches, else the heuristic."""
  tuned = load_tuning(OP, device_kind())
  if tuned is not None:
    config = config_from_entries(
        tuned["entries"], batch=batch, num_heads=num_heads, topk=topk
    )
    if config is not None:
      return config
  return heuristic_config(batch=batch, num_heads=num_heads, topk=topk)
