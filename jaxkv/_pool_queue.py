"""Vectorised list operations on the free queue, the parked list and the pending lists.

All lists are fixed-size int32 arrays padded with -1 past a dynamic count.
The free queue and the parked list are rings (a head index and a count), so
a pop or a push touches only the entries that move: a gather or a scatter of
the request-sized list, never a pass over the whole ring, except where
blocks leave from the middle (`take_front` with removals packs the queue).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._pool_state import ring_index


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


def push_freed(queue: Any, head: Any, num_free: Any, events: Any, hashed: Any, ranks: Any = None,
               enabled: Any = True) -> tuple[Any, Any, Any]:
  """Pushes freed blocks into the free queue, one block at a time in `events` order.

  A block without a prefix hash goes to the front, so the last one freed is
  the first reused (LIFO); a hashed block goes to the back, so the earliest
  freed cached block is evicted first (LRU). The result is
  `reversed(unhashed) + queue + hashed`: on the ring the head moves back by
  the number of unhashed events and the events are scattered around the old
  entries, which stay where they are.

  Args:
    queue: `[n]` free-queue ring; `head` its front, `num_free` its count.
    events: `[m]` freed block ids in free order, -1 padded.
    hashed: `[num_blocks]` bool, the blocks' hash flags.
    ranks: `event_ranks(events, hashed)` if the caller has them, else None.
    enabled: `[]` bool; False pushes nothing.

  Returns:
    `(queue, head, num_free)`.
  """
  n = queue.shape[0]
  is_hashed, ranks = event_ranks(events, hashed) if ranks is None else ranks
  valid = (events > 0) & enabled
  num_front = jnp.where(enabled, ranks[-1, 0], 0)
  num_back = jnp.where(enabled, ranks[-1, 1], 0)
  # Ranks count valid events only (< n), so every offset is in [-n, 2n).
  dest = jnp.where(is_hashed, ring_index(head, num_free + ranks[:, 1] - 1, n), ring_index(head, -ranks[:, 0], n))
  out = queue.at[jnp.where(valid, dest, n)].set(events, mode="drop")
  return out, ring_index(head, -num_front, n), num_free + num_front + num_back


def take_front(queue: Any, head: Any, num_free: Any, count: Any, kmax: int,
               remove: Any = None) -> tuple[Any, Any, Any, Any]:
  """Takes the blocks flagged in `remove` out of the queue, then pops `count` from the front.

  Args:
    queue: `[n]` free-queue ring; `head` its front, `num_free` its count.
    count: `[]` blocks to pop, at most what is left after the removals.
    kmax: static length of the popped list (at most n).
    remove: `[num_blocks]` bool or None (nothing removed).

  Returns:
    `(popped [kmax] padded with -1, queue, head, num_free)`.
  """
  n = queue.shape[0]
  k = jnp.arange(kmax, dtype=jnp.int32)
  if remove is None:
    # A pop reads `count` entries and clears them; nothing else moves.
    pos = ring_index(head, k, n)
    live = k < count
    popped = jnp.where(live, queue[pos], -1)
    popped, queue = jax.lax.optimization_barrier((popped, queue))  # read before the in-place clear
    queue = queue.at[jnp.where(live, pos, n)].set(-1, mode="drop")
    return popped, queue, ring_index(head, count, n), num_free - count
  # Removals leave holes: the kept entries are packed from index 0 (one scatter,
  # ranked in queue order straight from ring positions), then the pop is a slice.
  p = jnp.arange(n, dtype=jnp.int32)
  live = ring_index(-head, p, n) < num_free
  keep = live & ~remove[jnp.maximum(queue, 0)]
  run = prefix_sum(keep.astype(jnp.int32))
  total = run[-1]
  before = jnp.where(head > 0, run[jnp.maximum(head - 1, 0)], 0)  # kept entries ahead of the head
  rank = jnp.where(p >= head, run - before, run + total - before) - 1
  packed = jnp.full((n,), -1, jnp.int32).at[jnp.where(keep, rank, n)].set(queue, mode="drop")
  popped = jnp.where(k < count, packed[:kmax], -1)
  return popped, jnp.where(p >= count, packed, -1), count, total - count
