"""Vectorised list operations on the free queue, the parked list and the pending lists.

All lists are fixed-size int32 arrays padded with -1 past a dynamic count. The
free queue keeps its live entries at `[0, num_free)`, so a pop or a push to the
front moves every entry: that costs one gather over the queue (a single fused
pass, the same on every backend). Ranks (cumsums), scatters and searches run
over the items that change, never over the whole queue, except where blocks
leave from the middle (`take_front` with removals).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._pool_spec import PoolSpec


def prefix_sum(x: Any) -> Any:
  """Inclusive running sum along axis 0 of `[n]` or `[n, k]` int32.

  XLA lowers `cumsum` to a tree of reduce-windows (five or more kernels at
  any length, and slow on a CPU). Lists of a request batch are short, so they
  are summed in blocks of 32 with two masked reductions instead (two fused
  kernels, `n * 32 + (n / 32)**2` adds). Long ones are summed in blocks of 16
  (`n * 16` adds) plus the short sum of the block totals.
  """
  n = x.shape[0]
  b = min(n, 16 if n > 4096 else 32)
  a = -(-n // b)
  rest = x.shape[1:]
  xb = jnp.pad(x, [(0, a * b - n)] + [(0, 0)] * len(rest)).reshape((a, b) + rest)
  extra = (None,) * len(rest)
  i = jnp.arange(b)
  upto = (i[None, :] <= i[:, None])[(None, slice(None), slice(None)) + extra]
  within = jnp.sum(jnp.where(upto, xb[:, None], 0), axis=2)  # [a, b, ...]
  if n > 4096:
    total = within[:, -1]
    before = prefix_sum(total) - total
  else:
    ia = jnp.arange(a)
    earlier = (ia[None, :] < ia[:, None])[(slice(None), slice(None)) + extra]
    before = jnp.sum(jnp.where(earlier, within[None, :, -1], 0), axis=1)  # [a, ...]
  return (within + before[:, None]).reshape((a * b,) + rest)[:n]


def compact(ids: Any, keep: Any, size: int) -> tuple[Any, Any]:
  """Kept entries of `ids` in order, packed into `[size]` and padded with -1.

  Args:
    ids: `[n]` int32.
    keep: `[n]` bool.
    size: output length (kept entries beyond it are dropped).

  Returns:
    `(packed [size], count [])`.
  """
  pos = prefix_sum(keep.astype(jnp.int32)) - 1
  out = jnp.full((size,), -1, jnp.int32)
  out = out.at[jnp.where(keep, pos, size)].set(ids, mode="drop")
  return out, pos[-1] + 1


def append(lst: Any, count: Any, items: Any, valid: Any) -> tuple[Any, Any]:
  """Appends the valid `items` (in order) to a padded list; callers checked capacity."""
  size = lst.shape[0]
  pos = count + prefix_sum(valid.astype(jnp.int32)) - 1
  lst = lst.at[jnp.where(valid, pos, size)].set(items, mode="drop")
  return lst, pos[-1] + 1


def in_queue_mask(spec: PoolSpec, queue: Any, num_free: Any) -> Any:
  """`[num_blocks]` bool: block is in the free queue."""
  live = jnp.arange(queue.shape[0]) < num_free
  return jnp.zeros((spec.num_blocks,), bool).at[jnp.where(live, queue, spec.num_blocks)].set(
      True, mode="drop"
  )


def shifted(queue: Any, shift: Any, lo: Any, hi: Any) -> Any:
  """`out[i] = queue[i - shift]` for `lo <= i < hi`, -1 elsewhere; `|shift| <= n`.

  A dynamic slice of the -1 padded list (contiguous reads), not a gather.
  """
  n = queue.shape[0]
  i = jnp.arange(n, dtype=jnp.int32)
  pad = jnp.full((n,), -1, queue.dtype)
  src = jax.lax.dynamic_slice(jnp.concatenate([pad, queue, pad]), (n - shift,), (n,))
  return jnp.where((i >= lo) & (i < hi), src, -1)


def event_ranks(events: Any, hashed: Any) -> tuple[Any, Any]:
  """Inclusive ranks of freed blocks among the unhashed / hashed ones of `events`.

  Args:
    events: `[m]` freed block ids in free order, -1 padded.
    hashed: `[num_blocks]` bool, the blocks' hash flags.

  Returns:
    `(is_hashed [m] bool, ranks [m, 2] int32)`; `ranks[i].sum()` is the rank
    of event i among all valid events.
  """
  valid = events > 0
  is_hashed = hashed[jnp.maximum(events, 0)]
  front, back = valid & ~is_hashed, valid & is_hashed
  if events.shape[0] < 2**15:
    # Both counts fit in 16 bits: one running sum of `front + back * 2**16`
    # ranks both kinds (a trailing lane axis of 2 sums far slower on a CPU).
    ranks = prefix_sum(front.astype(jnp.int32) + back.astype(jnp.int32) * (1 << 16))
    return is_hashed, jnp.stack([ranks & 0xFFFF, ranks >> 16], axis=1)
  return is_hashed, prefix_sum(jnp.stack([front, back], axis=1).astype(jnp.int32))


def push_freed(queue: Any, num_free: Any, events: Any, hashed: Any, ranks: Any = None,
               enabled: Any = True) -> tuple[Any, Any]:
  """Pushes freed blocks into the free queue, one block at a time in `events` order.

  A block without a prefix hash goes to the front, so the last one freed is
  the first reused (LIFO); a hashed block goes to the back, so the earliest
  freed cached block is evicted first (LRU). The result is
  `reversed(unhashed) + queue + hashed`: the old entries shift by the number
  of unhashed events (one gather) and the events are scattered around them.

  Args:
    queue: `[num_blocks]` free queue; `num_free` its count.
    events: `[m]` freed block ids in free order, -1 padded.
    hashed: `[num_blocks]` bool, the blocks' hash flags.
    ranks: `event_ranks(events, hashed)` if the caller has them, else None.
    enabled: `[]` bool; False pushes nothing.
  """
  n = queue.shape[0]
  is_hashed, ranks = event_ranks(events, hashed) if ranks is None else ranks
  valid = (events > 0) & enabled
  num_front = jnp.where(enabled, ranks[-1, 0], 0)
  num_back = jnp.where(enabled, ranks[-1, 1], 0)
  dest = jnp.where(is_hashed, num_front + num_free + ranks[:, 1] - 1, num_front - ranks[:, 0])
  out = shifted(queue, num_front, num_front, num_front + num_free)
  out = out.at[jnp.where(valid, dest, n)].set(events, mode="drop")
  return out, num_free + num_front + num_back


def take_front(queue: Any, num_free: Any, count: Any, kmax: int, remove: Any = None) -> tuple[Any, Any, Any]:
  """Takes the blocks flagged in `remove` out of the queue, then pops `count` from the front.

  Args:
    queue: `[n]` free queue; `num_free` its count.
    count: `[]` blocks to pop, at most what is left after the removals.
    kmax: static length of the popped list.
    remove: `[num_blocks]` bool or None (nothing removed).

  Returns:
    `(popped [kmax] padded with -1, queue, num_free)`.
  """
  n = queue.shape[0]
  k = jnp.arange(kmax, dtype=jnp.int32)
  if remove is None:
    popped = jnp.where(k < count, queue[jnp.minimum(k, n - 1)], -1)
    return popped, shifted(queue, -count, 0, num_free - count), num_free - count
  live = jnp.arange(n) < num_free
  keep = live & ~remove[jnp.maximum(queue, 0)]
  pos = prefix_sum(keep.astype(jnp.int32)) - 1  # rank among the entries that stay
  left = pos[-1] + 1 - count
  # One scatter packs the kept entries; popped and rest are slices of them.
  packed = jnp.full((n,), -1, jnp.int32).at[jnp.where(keep, pos, n)].set(queue, mode="drop")
  popped = jnp.where(k < count, packed[:kmax], -1)
  return popped, shifted(packed, -count, 0, left), left
