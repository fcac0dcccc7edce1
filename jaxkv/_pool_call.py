"""How pool transitions are called: misuse checks, `debug=True` checkify, eager ValueError.

A transition body collects its misuse conditions with `Checks.require`. Inside
a caller's jit the body is traced inline: misused requests are dropped (they
change nothing and report `ok=False`), and with `debug=True` each condition is
also a `checkify.check` (wrap the caller in `checkify.checkify`) and the whole
state is left unchanged when any fails. Called eagerly with concrete values,
the body runs jitted under checkify and a failed check raises `ValueError`;
the caller's state object is never modified (states are immutable).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from ._pool_queue import prefix_sum
from ._pool_spec import PoolSpec


class Checks:
  """Collects misuse conditions of one transition call."""

  def __init__(self, debug: bool):
    self.debug = debug
    self.bad = jnp.asarray(False)

  def require(self, ok: Any, msg: str, **fmt: Any) -> None:
    """Records `ok` (a scalar bool); under debug it is also a checkify check."""
    self.bad = self.bad | ~ok
    if self.debug:
      checkify.check(ok, msg, **fmt)

  def require_requests(self, pad: Any, valid: Any, msg: str, **per_request: Any) -> None:
    """Requires every non-padding request to be valid.

    `msg` names the first bad request: `{i}` is its index and every keyword
    (a `[batch]` array) is formatted at that index.
    """
    bad = ~pad & ~valid
    i = first_bad(bad)
    self.require(~jnp.any(bad), msg, i=i, **{k: v[i] for k, v in per_request.items()})


def first_bad(bad: Any) -> Any:
  """Index of the first True of a 1-D mask (0 if none), for error messages."""
  return jnp.argmax(bad).astype(jnp.int32)


def _traced(tree: Any) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def transition(scope: str, static: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Turns `body(spec, state, *args, checks, **static) -> (state, result)` into a public transition.

  `static` names keyword arguments that shape the computation (hashable Python
  values): each distinct value compiles its own eager validator.
  """

  def deco(body: Callable[..., Any]) -> Callable[..., Any]:
    def run(spec, state, *args, debug, **kw):
      checks = Checks(debug)
      with jax.named_scope(scope):
        new, result = body(spec, state, *args, checks=checks, **kw)
        if debug:
          new = jax.tree.map(lambda old, upd: jnp.where(checks.bad, old, upd), state, new)
      return new, result

    @functools.cache
    def eager(kw_items):
      # Eager calls exist to validate; optimising their code would only slow compilation.
      return jax.jit(checkify.checkify(functools.partial(run, debug=True, **dict(kw_items))),
                     static_argnums=0, compiler_options={"xla_backend_optimization_level": 0})

    @functools.wraps(body)
    def public(spec, state, *args, debug=False, **kw):
      if not isinstance(spec, PoolSpec):
        raise ValueError(f"spec must be a PoolSpec, got {type(spec).__name__}")
      unknown = sorted(set(kw) - set(static))
      if unknown:
        raise TypeError(f"{body.__name__}() got unexpected keyword arguments {unknown}")
      if _traced((state, args)):
        return run(spec, state, *args, debug=debug, **kw)
      err, out = eager(tuple(sorted(kw.items())))(spec, state, *args)
      msg = err.get()
      if msg is not None:
        raise ValueError(msg.split("\n")[0].split(" (`check` failed)")[0])
      return out

    public.body = body
    return public

  return deco


def check_request_array(name: str, x: Any, shape: tuple[int, ...] | None = None, dtype: Any = jnp.int32) -> Any:
  """Static shape/dtype validation of a request argument (ValueError, never a cast)."""
  x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
  if x.dtype != dtype:
    raise ValueError(f"{name}.dtype={x.dtype} must be {jnp.dtype(dtype).name}")
  if shape is not None and x.shape != shape:
    raise ValueError(f"{name}.shape={x.shape} must be {shape}")
  return x


def seq_requests(spec: PoolSpec, state: Any, seq_ids: Any) -> tuple[Any, Any, Any]:
  """Common facts about a batch of sequence ids (-1 = padding).

  Returns:
    `(pad [B], sid [B] clipped to a valid row, unique_in_range [B])`.
  """
  s = spec.max_seqs
  pad = seq_ids == -1
  in_range = (seq_ids >= 0) & (seq_ids < s)
  sid = jnp.clip(seq_ids, 0, s - 1)
  b = seq_ids.shape[0]
  if b <= 64:
    # A short batch compares its ids pairwise: one fused pass, no [max_seqs] scratch.
    same = (seq_ids[:, None] == seq_ids[None, :]) & in_range[None, :]
    return pad, sid, in_range & (jnp.sum(same.astype(jnp.int32), axis=1) == 1)
  counts = jnp.zeros((s,), jnp.int32).at[jnp.where(in_range, seq_ids, s)].add(1, mode="drop")
  return pad, sid, in_range & (counts[sid] == 1)


def ceil_div(a: Any, b: int) -> Any:
  return (a + (b - 1)) // b


def cum_ok(valid: Any, need: Any, budget: Any) -> Any:
  """Requests served in order: one that needs something gets it while the running total fits."""
  cum = prefix_sum(jnp.where(valid, need, 0))
  return valid & ((need == 0) | (cum <= budget))
