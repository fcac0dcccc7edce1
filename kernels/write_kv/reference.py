"""The specification of write_kv: cache layouts and a sequential jnp scatter.

A cache layout names the physical order of the logical axes L (layers),
B (blocks), H (kv heads), N (slots of a block) and C (channels); L and H are
optional. Slot id `s` addresses block `s // N`, offset `s % N` (with N the
slot extent of the array, see `write_kv`). The new tokens' values `kv` are
always given in the canonical order `[tokens, L?, H?, C]`, i.e. the cache's
logical axes without B and N, with L before H.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Int, Shaped

from jaxkv._types import TOKENS

LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "BNC", "BNHC")
_CANONICAL = "LBNHC"


def check_layout(layout: str) -> None:
  """Raises ValueError unless `layout` is one of `LAYOUTS`."""
  if layout not in LAYOUTS:
    raise ValueError(f"{layout=} is not a supported layout; expected one of {LAYOUTS}")


def kv_axes(layout: str) -> str:
  """The logical axes of `kv` after its token axis, e.g. "LHC" for "BHLNC"."""
  return "".join(a for a in "LHC" if a in layout)


def kv_shape(cache_shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
  """The per-token shape of `kv` that a cache of `cache_shape` takes."""
  dims = dict(zip(layout, cache_shape))
  return tuple(dims[a] for a in kv_axes(layout))


def num_slots(cache_shape: tuple[int, ...], layout: str) -> int:
  """Number of addressable slots: blocks times the slot extent."""
  dims = dict(zip(layout, cache_shape))
  return dims["B"] * dims["N"]


def to_canonical(cache: Array, layout: str) -> Array:
  """Views `cache` as [L, B*N, H, C] (missing L/H axes get extent 1)."""
  present = [a for a in _CANONICAL if a in layout]
  x = jnp.transpose(cache, [layout.index(a) for a in present])
  for i, a in enumerate(_CANONICAL):
    if a not in layout:
      x = jnp.expand_dims(x, i)
  l, b, n, h, c = x.shape
  return x.reshape(l, b * n, h, c)


def from_canonical(x: Array, layout: str, cache_shape: tuple[int, ...]) -> Array:
  """Inverse of `to_canonical`."""
  dims = dict(zip(layout, cache_shape))
  full = {"L": 1, "H": 1, **dims}
  x = x.reshape(full["L"], full["B"], full["N"], full["H"], full["C"])
  drop = tuple(i for i, a in enumerate(_CANONICAL) if a not in layout)
  x = jnp.squeeze(x, drop) if drop else x
  present = [a for a in _CANONICAL if a in layout]
  return jnp.transpose(x, [present.index(a) for a in layout])


def write_kv_reference(
    cache: Shaped[Array, "..."],
    kv: Shaped[Array, f"{TOKENS} ..."],
    slot_mapping: Int[Array, f"{TOKENS}"],
    *,
    layout: str,
) -> Shaped[Array, "..."]:
  """Writes token `t`'s values into slot `slot_mapping[t]`, one token at a time.

  Tokens are applied in order, so of duplicate slots the last token wins; a
  negative slot or one past the last slot writes nothing. This sequential
  form is the specification; it is slow and meant for tests.

  Args:
    cache: the cache in `layout`, e.g. [num_blocks, block_size, 576] ("BNC").
    kv: [tokens, L?, H?, C] in the cache's dtype (see the module docstring).
    slot_mapping: [tokens] int32 slot ids, -1 for padding.
    layout: one of `LAYOUTS`.

  Returns:
    The updated cache, same shape and dtype.
  """
  check_layout(layout)
  canon = to_canonical(cache, layout)
  l, total, h, c = canon.shape
  rows = kv.reshape(kv.shape[0], l, h, c)

  def body(t, canon):
    s = slot_mapping[t]
    valid = (s >= 0) & (s < total)
    at = jnp.where(valid, s, 0).astype(jnp.int32)
    zero = jnp.int32(0)
    old = lax.dynamic_slice(canon, (zero, at, zero, zero), (l, 1, h, c))
    new = jnp.where(valid, rows[t][:, None], old)
    return lax.dynamic_update_slice(canon, new, (zero, at, zero, zero))

  canon = lax.fori_loop(0, kv.shape[0], body, canon)
  return from_canonical(canon, layout, cache.shape)
