"""The attention backend registry: what each backend serves and whether it needs zeroed blocks."""

from __future__ import annotations

import dataclasses
from typing import Literal

from ._specs import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

Masking = Literal["select", "multiply"]


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
  """A kernel family as the pool sees it.

  Attributes:
    name: registry key.
    spec_types: the spec types whose caches it reads.
    kernel_block_sizes: block sizes its kernel supports; a logical block is a
      whole number of kernel blocks.
    masking: "select" (masked slots never reach the accumulator: NaN-safe) or
      "multiply" (masked slots are accumulated with probability 0, so a NaN in
      an unwritten slot poisons the output).
    requires_kv_cache_zeroing: declared need for zeroed new blocks and tails.
      A "multiply" backend must declare True.
    entry: dotted path of the function that runs it (informative).
    mask_mode: the `mask_mode=` its entry is called with, where it has one.
  """

  name: str
  spec_types: tuple[type[KVCacheSpec], ...]
  kernel_block_sizes: tuple[int, ...]
  masking: str
  requires_kv_cache_zeroing: bool
  entry: str = ""
  mask_mode: str | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"backend name={self.name!r} must be a non-empty str")
    if not (isinstance(self.spec_types, tuple) and all(
        isinstance(t, type) and issubclass(t, KVCacheSpec) for t in self.spec_types)):
      raise ValueError(
          f"backend {self.name!r}: spec_types={self.spec_types!r} must be a tuple of KVCacheSpec"
          " subclasses")
    if self.masking not in ("select", "multiply"):
      raise ValueError(f"backend {self.name!r}: masking={self.masking!r} must be 'select' or 'multiply'")
    if not isinstance(self.requires_kv_cache_zeroing, bool):
      raise ValueError(
          f"backend {self.name!r}: requires_kv_cache_zeroing={self.requires_kv_cache_zeroing!r}"
          " must be a bool")
    if self.masking == "multiply" and not self.requires_kv_cache_zeroing:
      raise ValueError(
          f"backend {self.name!r}: masking='multiply' accumulates p*v over masked"
          " slots, so requires_kv_cache_zeroing must be True"
      )
    if not self.spec_types:
      raise ValueError(f"backend {self.name!r}: spec_types must not be empty")
    sizes = self.kernel_block_sizes
    if not (isinstance(sizes, tuple) and sizes and all(
        isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in sizes)):
      raise ValueError(
          f"backend {self.name!r}: kernel_block_sizes={sizes!r} must be a non-empty tuple of"
          " positive ints")
    if not isinstance(self.entry, str):
      raise ValueError(f"backend {self.name!r}: entry={self.entry!r} must be a str")
    if self.mask_mode not in (None, "select", "multiply"):
      raise ValueError(
          f"backend {self.name!r}: mask_mode={self.mask_mode!r} must be None, 'select' or"
          " 'multiply'")

  def serves(self, spec_type: type[KVCacheSpec]) -> bool:
    # Exact types: a full-attention kernel must not silently serve the
    # sliding-window subclass, whose window it would ignore.
    return spec_type in self.spec_types


@dataclasses.dataclass(frozen=True)
class CompositeBackend:
  """A prefill backend and a decode backend reading the same cache."""

  name: str
  prefill: AttentionBackend
  decode: AttentionBackend

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"composite name={self.name!r} must be a non-empty str")
    for role in ("prefill", "decode"):
      if not isinstance(getattr(self, role), AttentionBackend):
        raise ValueError(
            f"composite {self.name!r}: {role}={getattr(self, role)!r} must be an AttentionBackend")
    if not self.spec_types:
      raise ValueError(
          f"composite {self.name!r}: {self.prefill.name!r} and {self.decode.name!r} share no spec type"
      )
    if not self.kernel_block_sizes:
      raise ValueError(
          f"composite {self.name!r}: {self.prefill.name!r} and {self.decode.name!r} share no kernel block size"
      )

  @property
  def children(self) -> tuple[AttentionBackend, AttentionBackend]:
    return (self.prefill, self.decode)

  @property
  def spec_types(self) -> tuple[type[KVCacheSpec], ...]:
    return tuple(t for t in self.prefill.spec_types if self.decode.serves(t))

  @property
  def kernel_block_sizes(self) -> tuple[int, ...]:
    return tuple(b for b in self.prefill.kernel_block_sizes if b in self.decode.kernel_block_sizes)

  @property
  def masking(self) -> Masking:
    return "multiply" if "multiply" in (self.prefill.masking, self.decode.masking) else "select"

  @property
  def requires_kv_cache_zeroing(self) -> bool:
    return self.prefill.requires_kv_cache_zeroing or self.decode.requires_kv_cache_zeroing

  def serves(self, spec_type: type[KVCacheSpec]) -> bool:
    return self.prefill.serves(spec_type) and self.decode.serves(spec_type)


Backend = AttentionBackend | CompositeBackend
_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
  """Adds a backend to the registry; a second registration of a name is an error."""
  if not isinstance(backend, (AttentionBackend, CompositeBackend)):
    raise ValueError(f"backend must be an AttentionBackend or CompositeBackend, got {backend!r}")
  if backend.name in _REGISTRY and not replace:
    raise ValueError(f"backend {backend.name!r} is already registered")
  _REGISTRY[backend.name] = backend
  return backend


def get_backend(name: str) -> Backend:
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(f"unknown backend {name!r}; registered: {sorted(_REGISTRY)}") from None


def registered_backends() -> tuple[Backend, ...]:
  return tuple(_REGISTRY.values())


_MLA_BLOCKS = (32, 64, 128)

XLA_MLA_REFERENCE = register_backend(AttentionBackend(
    "xla_mla_reference", (MLAAttentionSpec,), _MLA_BLOCKS, "select", False,
    entry="jaxkv.kernels.mla_decode_reference", mask_mode="select"))
PALLAS_MLA_SELECT = register_backend(AttentionBackend(
    "pallas_mla_decode_select", (MLAAttentionSpec,), _MLA_BLOCKS, "select", False,
    entry="jaxkv.kernels.mla_decode", mask_mode="select"))
PALLAS_MLA_MULTIPLY = register_backend(AttentionBackend(
    "pallas_mla_decode_multiply", (MLAAttentionSpec,), _MLA_BLOCKS, "multiply", True,
    entry="jaxkv.kernels.mla_decode", mask_mode="multiply"))
PALLAS_SPARSE_MLA_SELECT = register_backend(AttentionBackend(
    "pallas_sparse_mla_decode_select", (MLAAttentionSpec,), _MLA_BLOCKS, "select", False,
    entry="jaxkv.kernels.sparse_mla_decode", mask_mode="select"))
PALLAS_SPARSE_MLA_MULTIPLY = register_backend(AttentionBackend(
    "pallas_sparse_mla_decode_multiply", (MLAAttentionSpec,), _MLA_BLOCKS, "multiply", True,
    entry="jaxkv.kernels.sparse_mla_decode", mask_mode="multiply"))
XLA_FULL_ATTENTION_REFERENCE = register_backend(AttentionBackend(
    "xla_full_attention_reference", (FullAttentionSpec, SlidingWindowSpec), (16, 32, 64, 128),
    "select", False))
XLA_LINEAR_ATTENTION_REFERENCE = register_backend(AttentionBackend(
    "xla_linear_attention_reference", (MambaSpec,), (1, 16, 32, 64, 128), "select", False))
# Prefill through the NaN-safe reference, decode through the multiply kernel: the
# composite needs zeroing because one child does.
MLA_PREFILL_DECODE_MULTIPLY = register_backend(CompositeBackend(
    "mla_reference_prefill_pallas_decode_multiply", XLA_MLA_REFERENCE, PALLAS_MLA_MULTIPLY))
MLA_PREFILL_DECODE_SELECT = register_backend(CompositeBackend(
    "mla_reference_prefill_pallas_decode_select", XLA_MLA_REFERENCE, PALLAS_MLA_SELECT))
