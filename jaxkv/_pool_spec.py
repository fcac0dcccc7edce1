"""The static shape and policy of a block pool: `PoolSpec`, a jit static argument."""

from __future__ import annotations

import dataclasses


def _positive_int(name: str, value: object, minimum: int = 1) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


@dataclasses.dataclass(frozen=True)
class PoolSpec:
  """Sizes and policy of one block pool; hashable, so it is a static jit argument.

  Attributes:
    num_blocks: blocks in the pool, block 0 (the null block) included.
    block_size: token slots per block.
    max_seqs: rows of the block table (sequence ids are `0 .. max_seqs-1`).
    max_blocks_per_seq: columns of the block table.
    zero_new_blocks: whether newly allocated blocks are queued for zeroing
      (decided by the zeroing policy, `pool_zeroing_plan`; the pool obeys it).
      Tails of completed loads and blocks of failed loads follow the same flag.
    enable_prefix_caching: register full prompt blocks by hash and reuse them.
    defer_block_free: park freed blocks behind a fence until the step that may
      still write them is marked processed (two steps in flight).
    max_zero_list: capacity of the pending zero list.
    max_tails: capacity of the pending tails list.
    hash_table_size: slots of the direct-mapped prefix index (a power of two);
      0 picks the power of two at or above `16 * num_blocks`. A digest whose
      slot holds another block is not registered (no prefix hit later), so
      the index is sparse: with 4x, 49 of the blocks an exact index would
      share were lost in the pool benchmark, with 16x 7 (4 bytes a slot).
  """

  num_blocks: int
  block_size: int
  max_seqs: int
  max_blocks_per_seq: int
  zero_new_blocks: bool = True
  enable_prefix_caching: bool = False
  defer_block_free: bool = False
  max_zero_list: int = 0
  max_tails: int = 0
  hash_table_size: int = 0

  def __post_init__(self):
    _positive_int("num_blocks", self.num_blocks, 2)
    _positive_int("block_size", self.block_size)
    _positive_int("max_seqs", self.max_seqs)
    _positive_int("max_blocks_per_seq", self.max_blocks_per_seq)
    for name in ("zero_new_blocks", "enable_prefix_caching", "defer_block_free"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
    if self.max_zero_list == 0:
      object.__setattr__(self, "max_zero_list", self.num_blocks)
    if self.max_tails == 0:
      object.__setattr__(self, "max_tails", self.max_seqs)
    _positive_int("max_zero_list", self.max_zero_list)
    _positive_int("max_tails", self.max_tails)
    if self.hash_table_size == 0:
      object.__setattr__(self, "hash_table_size", 1 << (16 * self.num_blocks - 1).bit_length())
    _positive_int("hash_table_size", self.hash_table_size)
    if self.hash_table_size & (self.hash_table_size - 1):
      raise ValueError(f"hash_table_size={self.hash_table_size} must be a power of two")
    if self.max_tokens_per_seq >= 2**31 or self.num_blocks * self.block_size >= 2**31:
      raise ValueError(
          f"num_blocks * block_size = {self.num_blocks * self.block_size} slots must fit in int32"
      )

  @property
  def max_tokens_per_seq(self) -> int:
    return self.max_blocks_per_seq * self.block_size

  @property
  def num_slots(self) -> int:
    return self.num_blocks * self.block_size
