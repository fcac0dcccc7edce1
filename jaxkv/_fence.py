"""Fences: the step counter and releasing parked blocks once their step is processed."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ._pool_call import transition
from ._pool_queue import shifted, push_freed
from ._pool_spec import PoolSpec
from ._pool_state import PoolState


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
  idx = jnp.arange(n)
  due = good & (idx < state.num_parked) & (state.parked_step <= step)
  k = jnp.sum(due.astype(jnp.int32))
  events = jnp.where(due, state.parked, -1)
  queue, num_free = push_freed(state.free_queue, state.num_free, events, state.hashed)
  fence = state.block_fence.at[jnp.where(due, state.parked, n)].set(-1, mode="drop")
  left = state.num_parked - k
  return state.replace(
      free_queue=queue,
      num_free=num_free,
      block_fence=fence,
      parked=shifted(state.parked, -k, 0, left),
      parked_step=shifted(state.parked_step, -k, 0, left),
      num_parked=state.num_parked - k,
      processed=jnp.where(good, jnp.maximum(state.processed, step), state.processed),
  ), k
