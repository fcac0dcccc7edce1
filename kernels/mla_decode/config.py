"""Tuning config of dense MLA decode: how many splits and how large each is."""

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

OP = "mla_decode"
MAX_SPLITS = 256
# Byte widths of the query's and KV ring's SMEM swizzle (`MLADecodeConfig.kv_swizzle`).
KV_SWIZZLES = (64, 128)
# Latent query channels the consumers keep in registers (`MLADecodeConfig.q_regs`).
Q_REGS = (0, 64, 128, 192)


def check_choice(name: str, value, choices) -> None:
  """A `ValueError` naming `name` unless `value` is one of `choices` (a bool
  never is, though False == 0)."""
  if isinstance(value, bool) or value not in choices:
    raise ValueError(f"{name}={value!r} must be one of {choices}")


@dataclasses.dataclass(frozen=True)
class MLADecodeConfig:
  """Static split-KV parameters (hashable; a jit static argument).

  The fields' own defaults are the kernel's base layout (64-byte swizzle, no
  query channels in registers), not the device's choice: to change one
  field, start from the device's config, e.g. `dataclasses.replace(
  default_config(batch=b, num_heads=h), num_splits=8)`.

  Attributes:
    num_splits: the most partial results (splits) one row may be cut into;
      the plan makes its parts longer rather than cut a row more often.
      1 never cuts a row (one part, one CTA per head group, holds them all).
    ctas_per_sm: CTAs (parts x head groups) the plan aims at per
      multiprocessor.
    min_chunk_blocks: the least cost a part carries, in 64-slot tiles
      (amortises the query loads, the pipeline fill and the partial-result
      writes of short steps).
    split_overhead_tiles: what one row segment costs a CTA beyond its tiles
      (query load, pipeline restart, partial store and merge), in tiles; the
      plan balances parts on tiles plus this per segment. 0 balances tiles
      alone.
    kv_swizzle: the byte width of the swizzle of the query and the KV ring
      in SMEM: 64 (32-column tiles; each consumer multiplies its own half
      of P into its values beside the other's softmax) or 128 (64-column
      tiles: TMA moves 128-byte rows, which stream faster, and each
      consumer's PV runs once per tile over all of P). Not a plan
      parameter: it changes the kernel, whatever plan it runs. The
      device's default config (tuned or heuristic) takes 128.
    q_regs: how many of the query's latent channels each consumer holds in
      registers for its QK (0, 64, 128 or 192; `q_regs / 4` registers per
      thread), so that the QK reads that much less of the query from SMEM.
      A kernel parameter, like kv_swizzle.
    implementation: what a compiled (non-interpreted) call runs: "pallas"
      (the Mosaic GPU kernels; a Hopper GPU, compute capability 9.0) or
      "xla" (the jnp reference, `mla_decode_reference`: the same results on
      any device, with the blocks gathered whole and unfused). The default
      config is "xla" on other GPUs. Interpreted calls run the kernels.
  """

  num_splits: int = 1
  ctas_per_sm: int = 1
  min_chunk_blocks: int = 8
  split_overhead_tiles: int = 4
  kv_swizzle: int = 64
  q_regs: int = 0
  implementation: str = "pallas"

  def __post_init__(self):
    for name in ("num_splits", "ctas_per_sm", "min_chunk_blocks"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    value = self.split_overhead_tiles
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 1024:
      raise ValueError(f"split_overhead_tiles={value!r} must be an int in [0, 1024]")
    if self.num_splits > MAX_SPLITS:
      raise ValueError(f"{self.num_splits=} must be at most {MAX_SPLITS}")
    check_choice("kv_swizzle", self.kv_swizzle, KV_SWIZZLES)
    check_choice("q_regs", self.q_regs, Q_REGS)
    check_choice("implementation", self.implementation, IMPLEMENTATIONS)


def heuristic_config(*, batch: int, num_heads: int, num_sms: int | None = None) -> MLADecodeConfig:
  """A config for any device: one CTA per SM, rows cut as often as balance needs.

  With `P` parts per head group, a row of average length spans about
  `P / batch + 1` parts; rows up to 1.5x the average fit `num_splits`
  without lengthening the parts. The merge reads every split slot, so no
  more are reserved than that.
  """
  if num_sms is None:
    num_sms = device_sms()
  head_groups = -(-num_heads // 64)
  parts = max(1, num_sms // head_groups)
  splits = -(-3 * parts // (2 * max(batch, 1))) + 2
  return MLADecodeConfig(
      num_splits=max(2, min(splits, parts + 1, MAX_SPLITS)),
      ctas_per_sm=1,
      # Parts of at least 4 tiles: where a step has fewer than 16 per SM
      # (batch 1-2 at 32K-64K), 16 left most SMs idle (1 x 64 x 32K on the
      # H200: 0.048 ms on 33 parts, 0.032 on 128; NOTES.md).
      min_chunk_blocks=4,
      # The 128-byte swizzle streams faster. One head group is bound by the
      # stream; two by the consumers' chain, which the query's first 128
      # channels in registers shorten. The 64-byte swizzle, which keeps that
      # chain shorter, won at two head groups on the H200 once (2026-12-01);
      # on 2026-12-06 the 128-byte one ran 0.97-1.00 of its time there and
      # 0.95-0.99 on an H100, at 72-128 heads (NOTES.md).
      kv_swizzle=128,
      q_regs=0 if head_groups == 1 else 128,
      implementation=default_implementation(),
  )


def config_from_entries(
    entries: list[dict[str, Any]], *, batch: int, num_heads: int, num_sms: int | None = None
) -> MLADecodeConfig | None:
  """The first tuned entry whose batch range and `heads` match, as a config.

  An entry matches `min_batch <= batch <= max_batch` (`min_batch` defaults
  to 1, `max_batch` to no bound) and `num_heads in heads`. Its `config`
  fields replace those of `heuristic_config` for this batch and heads (on
  `num_sms` multiprocessors), so an entry names only what its device's
  sweep changed: `{"heads": [128], "config": {"q_regs": 64}}` keeps the
  heuristic's split count at every batch.
  """
  for entry in entries:
    in_batch = entry.get("min_batch", 1) <= batch <= entry.get("max_batch", batch)
    if in_batch and num_heads in entry["heads"]:
      base = heuristic_config(batch=batch, num_heads=num_heads, num_sms=num_sms)
      return dataclasses.replace(base, **entry["config"])
  return None


def default_config(*, batch: int, num_heads: int, num_sms: int | None = None) -> MLADecodeConfig:
  """The tuned config of this device where one matches, else the heuristic
  (for `num_sms` multiprocessors; None: the device's), which runs the jnp
  reference on a GPU that cannot run the kernels."""
  tuned = load_tuning(OP, device_kind())
  if tuned is not None:
    config = config_from_entries(tuned["entries"], batch=batch, num_heads=num_heads,
                                 num_sms=num_sms)
    if config is not None:
      return config
  return heuristic_config(batch=batch, num_heads=num_heads, num_sms=num_sms)
