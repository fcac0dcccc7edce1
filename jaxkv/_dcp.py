"""Decode context parallelism: how many of a block's tokens a rank holds."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def _check(name: str, x: Any, lo: int, hi: int | None) -> None:
  """Range check of a concrete argument; traced values are not checked."""
  if isinstance(x, jax.core.Tracer):
    return
  v = np.asarray(x)
  if not np.issubdtype(v.dtype, np.integer):
    raise ValueError(f"{name} must be an integer, got {name}.dtype={v.dtype}")
  if (v < lo).any() or (hi is not None and (v > hi).any()):
    upper = "" if hi is None else f", {hi}"
    raise ValueError(f"{name} must be in [{lo}{upper}], got {name}={v}")


def local_valid_slots(
    num_valid: Any, dcp_size: int, dcp_rank: Any, interleave: int = 1
) -> Any:
  """Rank-local count of valid slots under decode context parallelism.

  Tokens are dealt to ranks in runs of `interleave`: token `t` lives on rank
  `(t // interleave) % dcp_size`, at the next free rank-local slot. So of the
  first `num_valid` tokens, rank `dcp_rank` holds
  `(num_valid // (dcp_size * interleave)) * interleave` from whole rounds plus
  `clip(num_valid % (dcp_size * interleave) - dcp_rank * interleave, 0,
  interleave)` from the last, partial round. Apply it to a block's token
  count when a logical block's size is a multiple of
  `dcp_size * interleave` (then the block starts a round), or to the whole
  sequence length and take the remainder modulo the rank-local block size.

  Args:
    num_valid: valid tokens, a Python int or an int array of any shape
      (traced values welcome: the function jits).
    dcp_size: number of decode-context-parallel ranks (>= 1).
    dcp_rank: this rank, in `[0, dcp_size)`; int or int array.
    interleave: tokens per run dealt to one rank (>= 1).

  Returns:
    The rank-local valid count: a Python int if every argument is one, else
    an int32 array broadcast from `num_valid` and `dcp_rank`.
  """
  _check("dcp_size", dcp_size, 1, None)
  _check("interleave", interleave, 1, None)
  _check("num_valid", num_valid, 0, None)
  if not isinstance(dcp_size, jax.core.Tracer):
    _check("dcp_rank", dcp_rank, 0, int(np.asarray(dcp_size)) - 1)
  round_len = dcp_size * interleave
  if not any(_is_array(x) for x in (num_valid, dcp_size, dcp_rank, interleave)):
    rest = num_valid % round_len - dcp_rank * interleave
    return (num_valid // round_len) * interleave + min(max(rest, 0), interleave)
  num_valid = jnp.asarray(num_valid, jnp.int32)
  dcp_rank = jnp.asarray(dcp_rank, jnp.int32)
  round_len = jnp.asarray(round_len, jnp.int32)
  interleave = jnp.asarray(interleave, jnp.int32)
  rest = num_valid % round_len - dcp_rank * interleave
  return (num_valid // round_len) * interleave + jnp.clip(rest, 0, interleave)
