"""Vectorised list operations on the free queue, the parked list and the pending lists.

All lists are fixed-size int32 arrays padded with -1 past a dynamic count. Every
operation is O(list size + items) with cumsum/scatter, never a loop over blocks.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from ._pool_spec import PoolSpec


def compact(ids: Any, keep: Any, size: int) -> tuple[Any, Any]:
  """Kept entries of `ids` in order, packed into `[size]` and padded with -1.

  Args:
    ids: `[n]` int32.
    keep: `[n]` bool.
    size: output length (kept entries beyond it are dropped).

  Returns:
    `(packed [size], count [])`.
  """
  pos = jnp.cumsum(keep.astype(jnp.int32)) - 1
  out = jnp.full((size,), -1, jnp.int32)
  out = out.at[jnp.where(keep, pos, size)].set(ids, mode="drop")
  return out, jnp.sum(keep.astype(jnp.int32))


def append(lst: Any, count: Any, items: Any, valid: Any) -> tuple[Any, Any]:
  """Appends the valid `items` (in order) to a padded list; callers checked capacity."""
  size = lst.shape[0]
  pos = count + jnp.cumsum(valid.astype(jnp.int32)) - 1
  lst = lst.at[jnp.where(valid, pos, size)].set(items, mode="drop")
  return lst, count + jnp.sum(valid.astype(jnp.int32))


def in_queue_mask(spec: PoolSpec, queue: Any, num_free: Any) -> Any:
  """`[num_blocks]` bool: block is in the free queue."""
  live = jnp.arange(queue.shape[0]) < num_free
  return jnp.zeros((spec.num_blocks,), bool).at[jnp.where(live, queue, spec.num_blocks)].set(
      True, mode="drop"
  )


def push_freed(queue: Any, num_free: Any, events: Any, hashed: Any) -> tuple[Any, Any]:
  """Pushes freed blocks into the free queue, one block at a time in `events` order.

  A block without a prefix hash goes to the front, so the last one freed is
  the first reused (LIFO); a hashed block goes to the back, so the earliest
  freed cached block is evicted first (LRU).

  Args:
    queue: `[num_blocks]` free queue; `num_free` its count.
    events: `[m]` freed block ids in free order, -1 padded.
    hashed: `[num_blocks]` bool, the blocks' hash flags.
  """
  n = queue.shape[0]
  safe = jnp.maximum(events, 0)
  is_hashed = hashed[safe]
  front = jnp.where((events > 0) & ~is_hashed, events, -1)[::-1]
  back = jnp.where((events > 0) & is_hashed, events, -1)
  live = jnp.where(jnp.arange(n) < num_free, queue, -1)
  ids = jnp.concatenate([front, live, back])
  return compact(ids, ids > 0, n)


def remove_from_queue(queue: Any, num_free: Any, remove: Any) -> tuple[Any, Any]:
  """Drops blocks with `remove[block]` from the queue, keeping the others' order."""
  n = queue.shape[0]
  live = (jnp.arange(n) < num_free) & (queue > 0)
  keep = live & ~remove[jnp.maximum(queue, 0)]
  return compact(queue, keep, n)


def pop_front(queue: Any, num_free: Any, count: Any, kmax: int) -> tuple[Any, Any, Any]:
  """Pops `count <= num_free` blocks from the front.

  Returns:
    `(popped [kmax] padded with -1, queue, num_free)`.
  """
  n = queue.shape[0]
  k = jnp.arange(kmax)
  popped = jnp.where(k < count, queue[jnp.minimum(k, n - 1)], -1)
  idx = jnp.arange(n) + count
  rest = jnp.where(idx < num_free, queue[jnp.minimum(idx, n - 1)], -1)
  return popped, rest, num_free - count
