"""KV cache groups and the hybrid pool: several groups overlaying one raw byte pool."""

from __future__ import annotations

import dataclasses

from ._specs import KVCacheSpec, is_recurrent, spec_dtypes


@dataclasses.dataclass(frozen=True)
class KVCacheGroup:
  """Layers that share block tables: one (merged) spec, one attention backend."""

  name: str
  layer_names: tuple[str, ...]
  spec: KVCacheSpec
  backend: str

  def __post_init__(self):
    if not self.name:
      raise ValueError("name must be a non-empty string")
    object.__setattr__(self, "layer_names", tuple(self.layer_names))
    if not self.layer_names:
      raise ValueError(f"group {self.name!r}: layer_names must not be empty")
    if len(set(self.layer_names)) != len(self.layer_names):
      raise ValueError(f"group {self.name!r}: layer_names has duplicates")
    if not isinstance(self.spec, KVCacheSpec):
      raise ValueError(f"group {self.name!r}: spec must be a KVCacheSpec, got {self.spec!r}")


@dataclasses.dataclass(frozen=True)
class HybridPoolSpec:
  """`num_blocks` blocks of raw bytes that every group's views overlay.

  Layer `j` of every group views raw tensor `j` (so `num_tensors` is the largest
  group's layer count); a block is `page_size_bytes` bytes in each tensor, the
  largest page of any group. A group whose page is smaller leaves
  `padding_bytes[group]` bytes of every block unused.
  """

  num_blocks: int
  groups: tuple[KVCacheGroup, ...]

  def __post_init__(self):
    if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 2:
      raise ValueError(f"num_blocks={self.num_blocks!r} must be an int >= 2 (block 0 is the null block)")
    object.__setattr__(self, "groups", tuple(self.groups))
    if not self.groups:
      raise ValueError("groups must hold at least one KVCacheGroup")
    names = [g.name for g in self.groups]
    if len(set(names)) != len(names):
      raise ValueError(f"group names must be unique, got {names}")
    layers = [l for g in self.groups for l in g.layer_names]
    if len(set(layers)) != len(layers):
      raise ValueError("a layer belongs to more than one group")
    # Blocks are shared ids: every group must cover the same tokens per block
    # unless it holds recurrent state, which ignores the slot count.
    attn = {g.spec.block_size for g in self.groups if not is_recurrent(g.spec)}
    if len(attn) > 1:
      raise ValueError(f"attention groups must share one block_size, got {sorted(attn)}")

  @property
  def page_size_bytes(self) -> int:
    return max(g.spec.page_size_bytes for g in self.groups)

  @property
  def padding_bytes(self) -> dict[str, int]:
    page = self.page_size_bytes
    return {g.name: page - g.spec.page_size_bytes for g in self.groups}

  @property
  def num_tensors(self) -> int:
    return max(len(g.layer_names) for g in self.groups)

  @property
  def tensor_bytes(self) -> int:
    return self.num_blocks * self.page_size_bytes

  @property
  def total_bytes(self) -> int:
    return self.num_tensors * self.tensor_bytes

  @property
  def is_overlaid(self) -> bool:
    return len(self.groups) > 1

  @property
  def mixes_dtypes(self) -> bool:
    """Groups of different dtypes share bytes: one reads another's bit patterns."""
    return self.is_overlaid and len({d for g in self.groups for d in spec_dtypes(g.spec)}) > 1

  @property
  def holds_recurrent_state(self) -> bool:
    return any(is_recurrent(g.spec) for g in self.groups)

  def group(self, name: str) -> KVCacheGroup:
    for g in self.groups:
      if g.name == name:
        return g
    raise ValueError(f"no group named {name!r}; groups are {[g.name for g in self.groups]}")
