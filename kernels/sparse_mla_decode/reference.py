"""The specification of sparse (top-k) MLA decode, in plain jnp with float32 accumulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxkv.kernels.mla_decode.reference import attention_reference
from jaxkv._types import BATCH, HEADS, TOPK, Lse, MLACache, MLAQuery

MASK_MODES = ("select", "multiply")
TopkIndices = Int[Array, f"{BATCH} {TOPK}"]


def sparse_mla_decode_reference(
    q: MLAQuery,
    cache: MLACache,
    indices: TopkIndices,
    *,
    sm_scale: float,
    dv: int = 512,
    mask_mode: str = "select",
) -> tuple[Float[Array, f"{BATCH} {HEADS} dv"], Lse]:
  """Absorbed MLA decode over the cache slots a row selected.

  Row `b` attends to the tokens in slots `indices[b, :]` (global slot id
  `block * block_size + offset`); `-1` marks an invalid entry, and so does
  any id outside `[0, num_blocks * block_size)` (a caller's stale or
  foreign id never reads some other slot). A slot listed twice counts twice.
  An invalid entry gets probability 0 in both modes. In
  "multiply" mode it is clamped to slot 0 (block 0, the null block) and that
  slot's value row is still accumulated with probability 0, so NaN there
  yields NaN in the row (as in production kernels); in "select" mode it never
  reaches the accumulator. A row without a valid entry attended to nothing:
  `out` 0 and `lse` -inf in both modes. A NaN in a valid entry's slot or in
  a head's query is data: those heads' `out` and `lse` come out NaN.

  Args:
    q: `[batch, heads, 576]` queries (512 latent + 64 RoPE channels).
    cache: `[num_blocks, block_size, 576]` latent cache.
    indices: `[batch, topk]` int32 global slot ids; -1 (or any id outside
      the cache) invalid.
    sm_scale: scale of the logits `q . k`.
    dv: value channels (the first `dv` cache channels).
    mask_mode: "select" or "multiply".

  Returns:
    `out` `[batch, heads, dv]` in q's dtype and `lse` `[batch, heads]`
    float32, the natural-log log-sum-exp of the scaled logits over the valid
    entries.
  """
  if mask_mode not in MASK_MODES:
    raise ValueError(f"{mask_mode=} must be one of {MASK_MODES}")
  with jax.named_scope("jaxkv.sparse_mla_decode_reference"):
    rows = cache.reshape(-1, cache.shape[-1])
    valid = (indices >= 0) & (indices < rows.shape[0])  # [batch, topk]
    kv = rows[jnp.where(valid, indices, 0)]  # [batch, topk, 576]
    # "multiply" accumulates every gathered row, clamped -1s included.
    keep = valid if mask_mode == "select" else jnp.ones_like(valid)
    return attention_reference(q, kv, valid, keep, sm_scale=sm_scale, dv=dv)
