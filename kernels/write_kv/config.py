"""Tuning of write_kv: which implementation runs and how the Pallas kernel tiles."""

from __future__ import annotations

import dataclasses

from jaxkv.kernels._common import device_kind, load_tuning, runs_kernels

BACKENDS = ("xla", "pallas")
# Shared memory of one H200 block is 232,448 bytes; leave room for several
# resident blocks per multiprocessor so that loads and stores overlap.
_SMEM_LIMIT = 227 * 1024


@dataclasses.dataclass(frozen=True)
class WriteKVConfig:
  """Static, hashable tuning of write_kv.

  Attributes:
    backend: "xla" (a donated scatter) or "pallas" (the Mosaic GPU kernel).
    tokens_per_block: tokens one Pallas grid step stages in SMEM.
    max_smem_bytes: cap on the SMEM staging tile of one grid step.
  """

  backend: str = "xla"
  tokens_per_block: int = 4
  max_smem_bytes: int = 48 * 1024

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"{self.backend=} must be one of {BACKENDS}")
    if not 1 <= self.tokens_per_block <= 256:
      raise ValueError(f"{self.tokens_per_block=} must be in [1, 256]")
    if not 1024 <= self.max_smem_bytes <= _SMEM_LIMIT:
      raise ValueError(f"{self.max_smem_bytes=} must be in [1024, {_SMEM_LIMIT}]")

  def blocking(self, tokens: int, num_q: int, row_bytes: int) -> tuple[int, int]:
    """(tokens_per_block, q_per_block) for a launch; q_per_block divides num_q.

    Rows of one token are split across grid steps only when one token's rows
    exceed the SMEM cap; tokens per step shrink before rows do.
    """
    q_per_block = 1
    for q in range(min(num_q, 256), 0, -1):
      if num_q % q == 0 and q * row_bytes <= self.max_smem_bytes:
        q_per_block = q
        break
    budget = max(1, self.max_smem_bytes // (q_per_block * row_bytes))
    tokens_per_block = max(1, min(self.tokens_per_block, tokens, budget))
    return tokens_per_block, q_per_block


def heuristic_config(layout: str, on_gpu: bool) -> WriteKVConfig:
  """The fallback where no tuned file exists (figures in NOTES.md).

  On the H200 the Pallas kernel beat XLA's scatter by 13-22% for a 61-layer
  cache (125 KB per token) and lost by 20-50% for an MLA cache (1 KB per
  token): many-layer layouts get the kernel on a GPU that runs it (Hopper).
  Elsewhere the kernel would run in the interpreter or not at all, so XLA is
  the default there.
  """
  if on_gpu and "L" in layout:
    return WriteKVConfig("pallas", tokens_per_block=4)
  return WriteKVConfig("xla")


def get_config(layout: str, kind: str | None = None) -> WriteKVConfig:
  """The tuned config for a layout on a device kind (default: the first device's).

  The JSON maps "default" and optionally "multi_layer" (layouts with an L
  axis) to `WriteKVConfig` fields.
  """
  kind = kind or device_kind()
  tuned = load_tuning("write_kv", kind)
  if tuned is None:
    return heuristic_config(layout, on_gpu=runs_kernels())
  entry = tuned.get("multi_layer") if "L" in layout else None
  return WriteKVConfig(**(entry or tuned["default"]))
