"""Tuning config of dense MLA decode: how many splits and how large each is."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxkv.kernels._common import device_kind, load_tuning

OP = "mla_decode"
MAX_SPLITS = 256


@dataclasses.dataclass(frozen=True)
class MLADecodeConfig:
  """Static split-KV parameters (hashable; a jit static argument).

  Attributes:
    num_splits: the grid's splits per (row, head group): an upper bound, the
      plan leaves the excess empty.
    ctas_per_sm: CTAs of work the plan aims at per multiprocessor; more
      balances varied lengths better, fewer writes fewer partial results.
    min_chunk_blocks: the fewest blocks a split reads (amortises the query
      load, the pipeline fill and the partial-result write).
  """

  num_splits: int = 1
  ctas_per_sm: int = 2
  min_chunk_blocks: int = 8

  def __post_init__(self):
    for name in ("num_splits", "ctas_per_sm", "min_chunk_blocks"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    if self.num_splits > MAX_SPLITS:
      raise ValueError(f"{self.num_splits=} must be at most {MAX_SPLITS}")


def heuristic_config(*, batch: int, num_heads: int, num_sms: int = 132) -> MLADecodeConfig:
  """A config for any device: enough splits to give every SM one CTA of work.

  One CTA's worth per SM with chunks of at least 32 blocks measured 5-30%
  faster than two on the H200 (fewer partial outputs to write and merge);
  see kernels/mla_decode/NOTES.md.
  """
  head_groups = -(-num_heads // 64)
  ctas_per_sm = 1
  splits = -(-2 * ctas_per_sm * num_sms // max(batch * head_groups, 1))
  return MLADecodeConfig(
      num_splits=max(1, min(splits, MAX_SPLITS)),
      ctas_per_sm=ctas_per_sm,
      min_chunk_blocks=32,
  )


def config_from_entries(
    entries: list[dict[str, Any]], *, batch: int, num_heads: int
) -> MLADecodeConfig | None:
  """The first tuned entry whose `max_batch` / `heads` match, as a config."""
  for entry in entries:
    if batch <= entry["max_batch"] and num_heads in entry["heads"]:
      return MLADecodeConfig(**entry["config"])
  return None


def default_config(*, batch: int, num_heads: int) -> MLADecodeConfig:
  """The tuned config of this device where one matches, else the heuristic."""
  tuned = load_tuning(OP, device_kind())
  if tuned is not None:
    config = config_from_entries(tuned["entries"], batch=batch, num_heads=num_heads)
    if config is not None:
      return config
  return heuristic_config(batch=batch, num_heads=num_heads)
