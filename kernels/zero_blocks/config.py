"""Tuning knobs of zero_blocks: SMEM zero-tile size, work split and grid size."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxkv.kernels._common import (
    IMPLEMENTATIONS,
    default_implementation,
    device_kind,
    load_tuning,
)

# An H200 has 132 SMs; two CTAs per SM keep TMA stores in flight while one CTA
# reads its next work item.
_DEFAULT_CTAS = 264
_MAX_TMA_BOX = 256  # elements per TMA box dimension


@dataclasses.dataclass(frozen=True)
class ZeroBlocksConfig:
  """Static launch parameters of one zero_blocks kernel.

  Attributes:
    tile_bytes: target size in bytes of the SMEM zero tile; one TMA store
      writes at most one tile. The rows per tile are the largest power of two
      with `rows * row_bytes <= tile_bytes` (at least 1, at most 256).
    item_rows: work items longer than this many rows are split into pieces of
      at most `item_rows` rows, so that CTAs share long items evenly (a power
      of two, so that pieces are whole zero tiles).
    num_ctas: CTAs of the persistent grid; each walks the work items
      `cta, cta + num_ctas, ...`.
    prefetch: work items a CTA loads ahead of the one it is storing.
    implementation: what a compiled (non-interpreted) call runs: "pallas"
      (the Mosaic GPU kernel; a Hopper GPU, compute capability 9.0) or
      "xla" (a scatter of zeros into exactly the same rows, in place on a
      donated cache: any device). The default is "xla" on other GPUs.
  """

  tile_bytes: int = 32 * 1024
  item_rows: int = 256
  num_ctas: int = _DEFAULT_CTAS
  prefetch: int = 2
  implementation: str = "pallas"

  def __post_init__(self):
    if not 16 <= self.tile_bytes <= 200 * 1024:
      raise ValueError(f"{self.tile_bytes=} must be in [16, 204800] (SMEM).")
    if self.item_rows < 1 or self.item_rows & (self.item_rows - 1):
      raise ValueError(f"{self.item_rows=} must be a power of two.")
    if not 1 <= self.num_ctas <= 65535:
      raise ValueError(f"{self.num_ctas=} must be in [1, 65535].")
    if not 1 <= self.prefetch <= 8:
      raise ValueError(f"{self.prefetch=} must be in [1, 8].")
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"{self.implementation=} must be one of {IMPLEMENTATIONS}.")

  def rows_per_tile(self, row_bytes: int) -> int:
    """Rows of the SMEM zero tile for rows of `row_bytes` bytes (power of 2)."""
    rows = 1
    while rows * 2 <= _MAX_TMA_BOX and rows * 2 * row_bytes <= self.tile_bytes:
      rows *= 2
    return rows

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> ZeroBlocksConfig:
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown zero_blocks tuning keys {sorted(unknown)}")
    return cls(**d)


def get_config(row_bytes: int, kind: str | None = None) -> ZeroBlocksConfig:
  """The tuned config for rows of `row_bytes` bytes, else the heuristic one.

  The JSON maps `"default"` and optionally `"row_bytes=<n>"` to config fields;
  the most specific entry wins. Untuned, the defaults, with the scatter on a
  GPU that cannot run the kernel.
  """
  tuned = load_tuning("zero_blocks", kind or device_kind())
  if not tuned:
    return ZeroBlocksConfig(implementation=default_implementation())
  entry = dict(tuned.get("default", {}))
  entry.update(tuned.get(f"row_bytes={row_bytes}", {}))
  return ZeroBlocksConfig.from_dict(entry)
