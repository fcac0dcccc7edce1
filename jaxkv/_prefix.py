"""Prefix caching: chained block hashes and the direct-mapped index of cached blocks.

Hash. Block `j` of a prompt is identified by a 64-bit digest (two uint32
lanes) of its parent's digest and its own tokens: per lane,
`P_j = P_{j-1} * R + d_j (mod 2**32)` where `d_j` mixes every (position,
token) of the block through a murmur3-style finaliser. The recurrence is
linear in `P`, so every prefix digest is a cumulative sum (`P_j = R**j *
sum_i d_i * R**-i`, R odd hence invertible mod 2**32): no scan over blocks or
tokens, which keeps hashing a few vectorised passes on device. The stored
hash is the finalised `P_j` of both lanes.

Collisions. Lookups compare both lanes (64 bits). For random prompts the
chance that any two of `n` distinct cached prefixes share a digest is about
`n**2 / 2**65` (below 1e-8 for a million blocks), which we accept. The
polynomial is not a cryptographic hash: a deployment that must isolate
tenants against crafted collisions computes digests on the host (e.g. with
SHA-256, as vLLM does) and passes them to `admit`, which takes digests as
input and never looks at tokens.

Index. `hash_table[digest.lane0 & (H-1)]` holds the one block registered for
that slot (or -1). A new digest whose slot is taken is simply not cached
(lossy, like a direct-mapped hardware cache): lookups stay O(1) per block,
correctness never depends on the index (both lanes are compared), and at
the default `H >= 16 * num_blocks` at most a sixteenth of registrations can
be lost (at 4x the pool benchmark lost 49 shared blocks against an exact
index, at 16x 7; the table costs 4 bytes a slot and no time). Among
several new blocks of one call aiming at one empty slot the smallest block id
wins. A block is registered iff `hashed[block]`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, UInt32

from ._pool_queue import prefix_sum
from ._types import BATCH, MAX_BLOCKS, TOKENS

_SEEDS = (0x9E3779B9, 0x85EBCA6B)
_RADIX = (0x2C1B3C6D, 0x297A2D39)  # odd, so invertible mod 2**32
_TOKEN_MUL = np.uint32(0xCC9E2D51)
_POS_MUL = np.uint32(0x1B873593)


def _fmix(h: Any) -> Any:
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _powers(r: int, n: int) -> tuple[np.ndarray, np.ndarray]:
  inv = pow(r, -1, 2**32)
  fwd = np.array([pow(r, j, 2**32) for j in range(n)], np.uint32)
  bwd = np.array([pow(inv, j, 2**32) for j in range(n)], np.uint32)
  return fwd, bwd


def hash_prompt_blocks(
    tokens: Int[Array, f"{BATCH} {TOKENS}"], block_size: int
) -> UInt32[Array, f"{BATCH} {MAX_BLOCKS} 2"]:
  """Chained 64-bit digests of every full block of each row of `tokens`.

  The digest of block `j` depends on tokens `[0, (j+1) * block_size)` only,
  so tokens past a row's prompt length affect no block that lies inside it.

  Args:
    tokens: `[batch, tokens]` int32 token ids; `tokens` a multiple of
      `block_size`.
    block_size: tokens per block.

  Returns:
    `[batch, tokens // block_size, 2]` uint32 digests.
  """
  if block_size <= 0 or tokens.shape[1] % block_size:
    raise ValueError(f"{tokens.shape=} must have a token axis that is a multiple of {block_size=}")
  if tokens.dtype != jnp.int32:
    raise ValueError(f"{tokens.dtype=} must be int32")
  b, t = tokens.shape
  m = t // block_size
  with jax.named_scope("jaxkv.hash_prompt_blocks"):
    tok = tokens.astype(jnp.uint32).reshape(b, m, block_size)
    pos = (jnp.arange(block_size, dtype=jnp.uint32) * _POS_MUL)[None, None, :]
    # Both lanes at once, on a trailing axis: one running sum for the pair.
    seed = np.array(_SEEDS, np.uint32).reshape(1, 1, 1, 2)
    d = jnp.sum(_fmix(tok[..., None] * _TOKEN_MUL + pos[..., None] + seed), axis=2, dtype=jnp.uint32)
    d = _fmix(d ^ np.uint32(block_size))  # [b, m, 2] per-block digests
    fwd, bwd = zip(*(_powers(radix, m) for radix in _RADIX))
    fwd, bwd = np.stack(fwd, axis=-1), np.stack(bwd, axis=-1)  # [m, 2]
    # Running sum over blocks (mod 2**32) as masked sums: a cumsum is a
    # reduce-window tree, several slow kernels.
    # Rows and lanes share one trailing axis (a trailing axis of 2 sums slowly on a CPU).
    run = prefix_sum(jnp.moveaxis(d * bwd[None], 1, 0).reshape(m, b * 2)).reshape(m, b, 2)
    prefix = jnp.moveaxis(run, 0, 1) * fwd[None]
    return _fmix(prefix + seed[0])


def table_slot(hashes: Any, table_size: int) -> Any:
  """Index slot of digests `[..., 2]` in a table of `table_size` (a power of two)."""
  return (hashes[..., 0] & np.uint32(table_size - 1)).astype(jnp.int32)


def lookup(state: Any, hashes: Any, table_size: int) -> tuple[Any, Any]:
  """Hittable cached blocks for digests `[..., 2]`.

  Returns:
    `(found [...] bool, block [...] int32)`: found iff the slot's block holds
    this digest and is not parked behind a fence.
  """
  cand = state.hash_table[table_slot(hashes, table_size)]
  safe = jnp.maximum(cand, 0)
  same = jnp.all(state.block_hash[safe] == hashes, axis=-1)
  found = (cand > 0) & same & state.hashed[safe] & (state.block_fence[safe] <= state.processed)
  return found, cand


def evict(state: Any, blocks: Any, table_size: int) -> Any:
  """Drops the hashes of `blocks` (`[k]`, -1 padded) popped from the free queue."""
  n = state.hashed.shape[0]
  safe = jnp.maximum(blocks, 0)
  drop = (blocks > 0) & state.hashed[safe]
  slot = jnp.where(drop, table_slot(state.block_hash[safe], table_size), table_size)
  table = state.hash_table.at[slot].set(-1, mode="drop")
  hashed = state.hashed.at[jnp.where(drop, blocks, n)].set(False, mode="drop")
  return state.replace(hash_table=table, hashed=hashed)


def register(state: Any, blocks: Any, hashes: Any, table_size: int) -> Any:
  """Registers new blocks `[k]` (-1 padded) under digests `[k, 2]` where their slot is free."""
  n = state.hashed.shape[0]
  slot = table_slot(hashes, table_size)
  empty = (blocks > 0) & (state.hash_table[slot] < 0)
  # Each empty slot (-1) picks its smallest new block with a scatter-min of
  # `block - n - 1` (< -1) into the table itself, then holds the winner. The
  # barriers order each read before the next in-place update (no table copy).
  empty, table = jax.lax.optimization_barrier((empty, state.hash_table))
  table = table.at[jnp.where(empty, slot, table_size)].min(blocks - n - 1, mode="drop")
  win = empty & (table[slot] == blocks - n - 1)
  win, table = jax.lax.optimization_barrier((win, table))
  table = table.at[jnp.where(win, slot, table_size)].set(blocks, mode="drop")
  target = jnp.where(win, blocks, n)
  return state.replace(
      hash_table=table,
      hashed=state.hashed.at[target].set(True, mode="drop"),
      block_hash=state.block_hash.at[target].set(hashes, mode="drop"),
  )
