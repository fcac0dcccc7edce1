"""Fences: the step counter and releasing parked blocks once their step is processed."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ._pool_call import transition
from ._pool_spec import PoolSpec
from ._pool_state import PoolState, ring_index


def advance_step(spec: PoolSpec, state: PoolState) -> tuple[PoolState, Any]:
  """Starts the next step: blocks freed from now on are fenced by its id.

  Args:
    spec: the pool spec (static).
    state: the pool state.

  Returns:
    `(state, step [] int32)`: the new step id.
  """
  if not isinstance(spec, PoolSpec):
    raise ValueError(f"spec must be a PoolSpec, got {type(spec).__name__}")
  with jax.named_scope("jaxkv.advance_step"):
    step = state.step + 1
    return state.replace(step=step), step


@transition("jaxkv.mark_processed")
def mark_processed(spec: PoolSpec, state: PoolState, step: Int[Array, ""], *, checks: Any) -> tuple[PoolState, Any]:
  """Marks every step up to `step` processed; blocks parked behind them are released.

  Released blocks enter the free queue in the order they were freed, exactly
  as an immediate free would have placed them (unhashed to the front, cached
  to the back). Steps are processed in order, so the released blocks are a
  prefix of the parked list.

  Args:
    spec: the pool spec (static).
    state: the pool state.
    step: `[]` int32, at most the current step (`state.step`).
    debug: (keyword) checkify misuse inside jit and leave the state unchanged.

  Returns:
    `(state, released [] int32)`: how many blocks returned to the free queue.

  Raises:
    ValueError: called eagerly with a step that has not started or is negative.
  """
  step = jnp.asarray(step)
  if step.shape != () or step.dtype != jnp.int32:
    raise ValueError(f"{step.shape=} {step.dtype=} must be a scalar int32")
  good = (step >= 0) & (step <= state.step)
  checks.require(good, "mark_processed: step={s} is negative or has not started (current step {c})",
                 s=step, c=state.step)
  n = spec.num_blocks
  info = state.parked_info
  # Each parked ring is in free order, so its steps never decrease: the due
  # entries are a leading run, counted from samples (no pass over it).
  k = _leading_due(info.reshape(2, 3, n)[:, 1], jnp.stack([state.parked_u_head, state.parked_h_head]),
                   jnp.stack([state.num_parked_u, state.num_parked_h]), step)
  ku, kh = jnp.where(good, k[0], 0), jnp.where(good, k[1], 0)
  # The release is `push_freed` of the due blocks in free order: the unhashed
  # run goes to the front reversed (last freed first), the hashed run to the
  # back in order. Both runs are rotations of their rings (contiguous reads,
  # no gather), selected in one pass over the queue ring.
  qh, nf = state.queue_head, state.num_free
  new_head = ring_index(qh, -ku, n)
  back = ring_index(qh, nf, n)
  p = jnp.arange(n, dtype=jnp.int32)
  tf = ring_index(-new_head, p, n)  # offset in the front run
  tb = ring_index(-back, p, n)  # offset in the back run
  # Queue slot p = new_head + t takes unhashed entry head_u + ku-1-t: with the
  # ring reversed (r[i] = u[n-1-i]) that is r[(p - new_head - head_u - ku) % n].
  src_u = _rotated(info[0, ::-1], jnp.remainder(-new_head - state.parked_u_head - ku, n))
  src_h = _rotated(info[3], ring_index(state.parked_h_head, -back, n))  # slot back + t: entry t
  queue = jnp.where(tf < ku, src_u, jnp.where(tb < kh, src_h, state.free_queue))
  return state.replace(
      free_queue=queue,
      queue_head=new_head,
      num_free=nf + ku + kh,
      parked_u_head=ring_index(state.parked_u_head, ku, n),
      num_parked_u=state.num_parked_u - ku,
      parked_h_head=ring_index(state.parked_h_head, kh, n),
      num_parked_h=state.num_parked_h - kh,
      processed=jnp.where(good, jnp.maximum(state.processed, step), state.processed),
  ), ku + kh


def _rotated(ring: Any, shift: Any) -> Any:
  """`out[p] = ring[(p + shift) % n]` for `0 <= shift < n`: a slice of the ring twice over."""
  n = ring.shape[0]
  return jax.lax.dynamic_slice(jnp.concatenate([ring, ring]), (shift,), (n,))


def _leading_due(steps: Any, heads: Any, counts: Any, step: Any) -> Any:
  """Per ring: how many entries from its head have a step <= `step` (steps nondecreasing).

  Two levels of samples (every `stride`-th entry, then the `stride` entries
  after the last due sample) instead of a pass over the ring or a search
  loop: two small fused gathers and sums.

  Args:
    steps: `[r, n]` ring storage; `heads`, `counts`: `[r]`.
  """
  n = steps.shape[1]
  stride = max(1, math.isqrt(n - 1) + 1)
  rows = jnp.arange(steps.shape[0])[:, None]

  def due_from(offsets):  # [r, k] offsets from the heads -> [r] due count
    at = ring_index(heads[:, None], jnp.minimum(offsets, n - 1), n)
    due = (offsets < counts[:, None]) & (steps[rows, at] <= step)
    return jnp.sum(due.astype(jnp.int32), axis=1)

  coarse = due_from(jnp.arange(0, n, stride, dtype=jnp.int32)[None, :])
  base = jnp.maximum(coarse - 1, 0) * stride
  return base + due_from(base[:, None] + jnp.arange(stride, dtype=jnp.int32)[None, :])
