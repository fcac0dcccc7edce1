"""Cache specs: static, hashable descriptions of what one layer stores per block."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import jax.numpy as jnp
from jax.typing import DTypeLike


def _dtype_name(value: Any, field: str) -> str:
  try:
    return jnp.dtype(value).name
  except TypeError as e:
    raise ValueError(f"{field}={value!r} is not a dtype") from e


def _positive_int(value: Any, field: str) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"{field}={value!r} must be a positive int")


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
  """Base of every spec: `block_size` slots per block of one `dtype`."""

  block_size: int
  kind: ClassVar[str] = "abstract"
  # Recurrent state is overwritten in place, not appended slot by slot.
  recurrent: ClassVar[bool] = False

  def __post_init__(self):
    _positive_int(self.block_size, "block_size")

  @property
  def page_size_bytes(self) -> int:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
  """Separate K and V heads: K `[num_kv_heads, head_size]`, V `[num_kv_heads, head_size_v]` per slot."""

  num_kv_heads: int = 1
  head_size: int = 128
  dtype: DTypeLike = "bfloat16"
  head_size_v: int | None = None
  kind: ClassVar[str] = "full_attention"

  def __post_init__(self):
    super().__post_init__()
    _positive_int(self.num_kv_heads, "num_kv_heads")
    _positive_int(self.head_size, "head_size")
    if self.head_size_v is None:
      object.__setattr__(self, "head_size_v", self.head_size)
    _positive_int(self.head_size_v, "head_size_v")
    object.__setattr__(self, "dtype", _dtype_name(self.dtype, "dtype"))

  @property
  def page_size_bytes(self) -> int:
    itemsize = jnp.dtype(self.dtype).itemsize
    return self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v) * itemsize


@dataclasses.dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
  """Full attention restricted to the last `sliding_window` tokens."""

  sliding_window: int = 4096
  kind: ClassVar[str] = "sliding_window"

  def __post_init__(self):
    super().__post_init__()
    _positive_int(self.sliding_window, "sliding_window")


@dataclasses.dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
  """One latent "head" per slot: `kv_lora_rank` latent + `rope_dim` RoPE channels; K and V share it."""

  kv_lora_rank: int = 512
  rope_dim: int = 64
  dtype: DTypeLike = "bfloat16"
  kind: ClassVar[str] = "mla"

  def __post_init__(self):
    super().__post_init__()
    _positive_int(self.kv_lora_rank, "kv_lora_rank")
    _positive_int(self.rope_dim, "rope_dim")
    object.__setattr__(self, "dtype", _dtype_name(self.dtype, "dtype"))

  @property
  def head_size(self) -> int:
    return self.kv_lora_rank + self.rope_dim

  @property
  def page_size_bytes(self) -> int:
    return self.block_size * self.head_size * jnp.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
  """Recurrent (SSM / linear-attention) state: one array per entry of `shapes`, per block."""

  shapes: Sequence[Sequence[int]] = ()
  dtypes: Sequence[DTypeLike] = ()
  kind: ClassVar[str] = "mamba"
  recurrent: ClassVar[bool] = True

  def __post_init__(self):
    super().__post_init__()
    if isinstance(self.shapes, (str, bytes)) or not self.shapes:
      raise ValueError(f"shapes={self.shapes!r} must name at least one state array shape")
    try:
      shapes = tuple(tuple(s) for s in self.shapes)
    except TypeError as e:
      raise ValueError(f"shapes={self.shapes!r} must be a sequence of shapes") from e
    if isinstance(self.dtypes, (str, bytes)) or len(shapes) != len(self.dtypes):
      raise ValueError(
          f"dtypes={self.dtypes!r} must be a sequence with one dtype per shape"
          f" ({len(shapes)} shapes)"
      )
    for i, shape in enumerate(shapes):
      for d in shape:
        _positive_int(d, f"shapes[{i}]")
    object.__setattr__(self, "shapes", tuple(tuple(int(d) for d in s) for s in shapes))
    object.__setattr__(
        self, "dtypes", tuple(_dtype_name(d, f"dtypes[{i}]") for i, d in enumerate(self.dtypes))
    )

  @property
  def page_size_bytes(self) -> int:
    return sum(math.prod(s) * jnp.dtype(d).itemsize for s, d in zip(self.shapes, self.dtypes))


def spec_dtypes(spec: KVCacheSpec) -> tuple[str, ...]:
  """Every dtype a spec stores."""
  if isinstance(spec, MambaSpec):
    return spec.dtypes
  if isinstance(spec, UniformTypeSpec):
    return tuple(dict.fromkeys(d for _, s in spec.layers for d in spec_dtypes(s)))
  return (spec.dtype,)  # type: ignore[attr-defined]


def _fields(spec: KVCacheSpec) -> dict[str, Any]:
  return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}


def merge(specs) -> KVCacheSpec:
  """Merges the specs of one group's layers into the group's spec.

  Args:
    specs: the layers' specs; at least one.

  Returns:
    The common spec.

  Raises:
    ValueError: naming the first differing type or field and the two values.
  """
  specs = tuple(specs)
  if not specs:
    raise ValueError("merge needs at least one spec")
  first = specs[0]
  for i, spec in enumerate(specs[1:], start=1):
    if type(spec) is not type(first):
      raise ValueError(
          f"cannot merge specs of different types: specs[0] is {type(first).__name__},"
          f" specs[{i}] is {type(spec).__name__}"
      )
    a, b = _fields(first), _fields(spec)
    for name in a:
      if a[name] != b[name]:
        raise ValueError(
            f"cannot merge specs: field {name!r} differs: specs[0].{name}={a[name]!r},"
            f" specs[{i}].{name}={b[name]!r}"
        )
  return first


@dataclasses.dataclass(frozen=True)
class UniformTypeSpec(KVCacheSpec):
  """Layers of one spec type whose pages differ in size, sharing block ids.

  One block id names a page in every layer; the group's page is the sum of the
  layers' pages. Built by `project_uniform_type`.
  """

  layers: tuple[tuple[str, KVCacheSpec], ...] = ()
  kind: ClassVar[str] = "uniform_type"

  def __post_init__(self):
    super().__post_init__()
    if not self.layers:
      raise ValueError("layers must hold at least one (name, spec) pair")
    types = {type(s) for _, s in self.layers}
    if len(types) != 1:
      raise ValueError(f"layers must share one spec type, got {sorted(t.__name__ for t in types)}")
    for name, spec in self.layers:
      if spec.block_size != self.block_size:
        raise ValueError(f"layer {name!r}: {spec.block_size=} differs from {self.block_size=}")

  @property
  def layer_type(self) -> type[KVCacheSpec]:
    return type(self.layers[0][1])

  @property
  def recurrent_state(self) -> bool:
    return self.layer_type.recurrent

  @property
  def page_size_bytes(self) -> int:
    return sum(s.page_size_bytes for _, s in self.layers)


def project_uniform_type(layer_specs) -> UniformTypeSpec | None:
  """Projects per-layer specs of one type onto a single uniform-type spec.

  Args:
    layer_specs: mapping (or pairs) of layer name to spec.

  Returns:
    A `UniformTypeSpec` when every layer has the same spec type and block size
    (page sizes may differ), else None.
  """
  pairs = tuple(layer_specs.items() if hasattr(layer_specs, "items") else layer_specs)
  if not pairs:
    return None
  if len({type(s) for _, s in pairs}) != 1 or len({s.block_size for _, s in pairs}) != 1:
    return None
  return UniformTypeSpec(block_size=pairs[0][1].block_size, layers=pairs)


def is_recurrent(spec: KVCacheSpec) -> bool:
  """Whether the spec holds recurrent state (directly or through a projection)."""
  if isinstance(spec, UniformTypeSpec):
    return spec.recurrent_state
  return type(spec).recurrent
