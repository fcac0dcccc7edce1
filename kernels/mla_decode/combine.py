"""Merge of split-KV partial results by log-sum-exp (plain jnp; XLA fuses it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxkv._types import BATCH, HEADS


def combine_splits(
    o: Float[Array, f"{BATCH} splits {HEADS} dv"],
    lse: Float[Array, f"{BATCH} splits {HEADS}"],
    *,
    empty_nan: bool = False,
) -> tuple[Float[Array, f"{BATCH} {HEADS} dv"], Float[Array, f"{BATCH} {HEADS}"]]:
  """Merges normalised partial outputs of disjoint slot ranges.

  A split with `lse = -inf` (no slots) has weight exactly 0 and its `o` is
  never multiplied in (so it may hold anything); a NaN in a non-empty split's
  `o` propagates, which "multiply" mode relies on, and so does a NaN `lse`
  (a split that met NaN in a valid slot or the query): the row's `out` and
  `lse` come out NaN, as one split over all its slots gives them.

  Args:
    o: `[batch, splits, heads, dv]` float32 per-split normalised outputs.
    lse: `[batch, splits, heads]` float32 per-split natural-log LSE.
    empty_nan: a NaN in an empty split's `o` (masked slots only, one of
      which "multiply" accumulated with weight 0) also turns the row's
      output into NaN, as a production merge that multiplies every split by
      its weight gives it; a row whose splits are all empty still gets 0.

  Returns:
    `out` `[batch, heads, dv]` float32 and `lse` `[batch, heads]` float32
    (`-inf` and `out = 0` where every split is empty).
  """
  with jax.named_scope("jaxkv.mla_decode_combine"):
    if o.shape[1] == 1:
      return jnp.where((lse[:, 0] != -jnp.inf)[..., None], o[:, 0], 0.0), lse[:, 0]
    m = jnp.max(lse, axis=1)  # [batch, heads]; NaN where a split's is
    live = lse != -jnp.inf  # NaN is live: its weight NaN poisons the row
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.where(live, jnp.exp(lse - m_safe[:, None, :]), 0.0)
    total = jnp.sum(w, axis=1)
    has = total != 0.0
    w = w / jnp.where(has, total, 1.0)[:, None, :]
    keep = live[..., None]
    if empty_nan:
      keep = keep | jnp.isnan(o)
    part = jnp.where(keep, o, 0.0) * w[..., None]
    out = jnp.sum(part, axis=1)
    if empty_nan:
      out = jnp.where(has[..., None], out, 0.0)
    lse_out = jnp.where(has, m_safe + jnp.log(jnp.where(has, total, 1.0)), -jnp.inf)
    return out, lse_out
