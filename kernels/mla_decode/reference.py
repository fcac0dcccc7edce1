"""The specification of dense paged MLA decode, in plain jnp with float32 accumulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxkv._types import BATCH, HEADS, BlockTable, Lse, MLACache, MLAQuery, SeqLens

MASK_MODES = ("select", "multiply")
READ_TILE = 64  # slots the kernels read at once ("multiply" reads whole tiles)


def mla_decode_reference(
    q: MLAQuery,
    cache: MLACache,
    block_table: BlockTable,
    seq_lens: SeqLens,
    *,
    sm_scale: float,
    dv: int = 512,
    mask_mode: str = "select",
) -> tuple[Float[Array, f"{BATCH} {HEADS} dv"], Lse]:
  """Absorbed MLA decode over a paged latent cache.

  Row `b` attends to its first `seq_lens[b]` tokens, token `t` living in slot
  `t % block_size` of block `block_table[b, t // block_size]`. The blocks a
  row *reads* are the `ceil(seq_len / block_size)` ones that hold its tokens;
  padded table entries past them are never dereferenced. An entry of a read
  block outside `[0, num_blocks)` reads as zeros (the kernel's copies fill
  out-of-bounds boxes with zeros), never some other block. Inside the last read
  block the slots at or past `seq_len` are unwritten: their scores are masked
  in both modes; in "multiply" mode the value rows of those the kernel reads
  (it reads in tiles of 64 slots: up to `seq_len` rounded up to
  `min(block_size, 64)`) are still accumulated with probability 0 (so NaN
  there yields NaN in the row, as in production kernels); in "select" mode
  they never reach the accumulator.

  Args:
    q: `[batch, heads, 576]` queries (512 latent + 64 RoPE channels).
    cache: `[num_blocks, block_size, 576]` latent cache.
    block_table: `[batch, max_blocks]` int32, padded with 0.
    seq_lens: `[batch]` int32; values are clipped to `[0, max_blocks *
      block_size]`.
    sm_scale: scale of the logits `q . k`.
    dv: value channels (the first `dv` cache channels).
    mask_mode: "select" or "multiply".

  Returns:
    `out` `[batch, heads, dv]` in q's dtype and `lse` `[batch, heads]`
    float32, the natural-log log-sum-exp of the scaled logits over valid slots
    (`-inf` and `out = 0` where `seq_len == 0`).
  """
  if mask_mode not in MASK_MODES:
    raise ValueError(f"{mask_mode=} must be one of {MASK_MODES}")
  with jax.named_scope("jaxkv.mla_decode_reference"):
    _, block_size, _ = cache.shape
    max_blocks = block_table.shape[1]
    span = max_blocks * block_size
    seq = jnp.clip(seq_lens, 0, span)
    inside = (block_table >= 0) & (block_table < cache.shape[0])
    kv = jnp.where(inside[:, :, None, None], cache[jnp.where(inside, block_table, 0)], 0)
    kv = kv.reshape(block_table.shape[0], span, cache.shape[-1])
    pos = jnp.arange(span, dtype=jnp.int32)[None, :]
    valid = pos < seq[:, None]  # [batch, span]
    unit = min(block_size, READ_TILE)
    read = pos < ((seq + unit - 1) // unit * unit)[:, None]
    keep = valid if mask_mode == "select" else read
    # Slots the kernel never reads cannot poison it in either mode.
    return attention_reference(q, kv, valid, keep, sm_scale=sm_scale, dv=dv)


def attention_reference(q, kv, valid, keep, *, sm_scale: float, dv: int):
  """Absorbed MLA attention of each row over its gathered latents, float32 accumulation.

  The shared core of the dense and sparse references.

  Args:
    q: `[batch, heads, 576]`.
    kv: `[batch, slots, 576]` the latents each row may read.
    valid: `[batch, slots]` bool: slots whose scores count (others get p = 0).
    keep: `[batch, slots]` bool: slots whose value rows are accumulated (as
      `p * v`, so a NaN in a kept, invalid slot poisons the row: "multiply");
      the others are replaced by zeros ("select" keeps exactly the valid ones).
    sm_scale: scale of the logits.
    dv: value channels (the first `dv` of each latent).

  Returns:
    `out` `[batch, heads, dv]` in q's dtype and `lse` `[batch, heads]` float32
    (`out` 0 and `lse` -inf for a row without a valid slot). A NaN (or an
    infinity) in a head's query or in a valid slot is data, not garbage: that
    head's `out` and `lse` come out NaN, as in any attention, whatever the
    kernels' split plan; masked slots' bytes never reach a score.
  """
  s = jnp.einsum("bhd,btd->bht", q, kv, preferred_element_type=jnp.float32) * jnp.float32(sm_scale)
  s = jnp.where(valid[:, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(m == -jnp.inf, 0.0, m)  # no valid slot; a NaN maximum stays
  p = jnp.exp(s - m)  # exactly 0 on masked slots
  l = jnp.sum(p, axis=-1)
  v = jnp.where(keep[:, :, None], kv[..., :dv], jnp.zeros((), kv.dtype))
  o = jnp.einsum("bht,btd->bhd", p, v.astype(jnp.float32), preferred_element_type=jnp.float32)
  has = l != 0.0  # a NaN sum (a NaN score) is not "no valid slot"
  o = jnp.where(has[..., None], o / jnp.where(has, l, 1.0)[..., None], 0.0)
  lse = jnp.where(has, m[..., 0] + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)
  return o.astype(q.dtype), lse
