"""write_kv: validates a KV write, then runs it as a donated XLA scatter or the Pallas kernel."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Shaped

from jaxkv.kernels._common import require_kernel_device, resolve_interpret
from jaxkv.kernels.write_kv import kernel as _kernel
from jaxkv.kernels.write_kv.config import BACKENDS, WriteKVConfig, get_config
from jaxkv.kernels.write_kv.reference import (
    check_layout,
    kv_axes,
    kv_shape,
    num_slots,
)

_DEFAULT_LAYOUT = {3: "BNC", 4: "BNHC", 5: "LBNHC"}


def write_kv(
    cache: Shaped[Array, "..."],
    kv: Shaped[Array, "..."],
    slot_mapping: Shaped[Array, "..."],
    *,
    layout: str | None = None,
    block_size: int | None = None,
    interpret: Any = None,
    backend: str | None = None,
    config: WriteKVConfig | None = None,
) -> Shaped[Array, "..."]:
  """Scatters new tokens' KV into their cache slots; negative slots write nothing.

  Slot `s` is block `s // N`, offset `s % N`, with N the slot extent of the
  array. The array may be in kernel-block units (as for `zero_blocks`): with a
  logical `block_size` r times N, logical block b is kernel blocks
  [b*r, (b+1)*r), so the global slot id `b * block_size + offset` lands in the
  same place and needs no translation; `block_size` is only validated.

  All layers are written at once: for a cache with an L axis, `kv` carries
  every layer's values of each token. To write one layer per call, keep one
  cache per layer ("BNHC", or "BNC" for MLA).

  Duplicate non-negative slots are rejected when `slot_mapping` is concrete.
  Under tracing they are not checked: such a slot ends up holding bytes of
  one of its tokens (unspecified which, possibly mixed) and no other slot is
  affected. Slots at or past `num_blocks * N` are rejected when concrete and
  skipped like padding when traced: they never write.

  The cache is donated: update in place, no copy of untouched slots. Call it
  inside a jitted step that donates the cache, or eagerly (the argument is
  then consumed). On bad input it raises ValueError before touching the cache.

  Args:
    cache: `[num_blocks, block_size, 576]` for MLA ("BNC"), or a full-attention
      cache in one of `reference.LAYOUTS`, e.g. `[blocks, slots, kv_heads,
      head_dim]` ("BNHC") or `[layers, blocks, slots, kv_heads, head_dim]`
      ("LBNHC").
    kv: `[tokens, L?, H?, C]` in the cache's dtype: the cache's logical axes
      without B and N, layers before heads (`[tokens, 576]` for MLA).
    slot_mapping: `[tokens]` int32 slot ids, -1 for padding.
    layout: the cache layout; default "BNC", "BNHC" or "LBNHC" by rank.
    block_size: logical block size, a multiple of the N extent (default N).
    interpret: see `resolve_interpret`; used by the Pallas backend only.
    backend: "xla" or "pallas"; default from the tuned config (on the
      H200: Pallas for layouts with an L axis, XLA otherwise; XLA on GPUs
      other than Hopper, where a compiled "pallas" is a `ValueError`).
    config: tuning; default the tuned config of this device kind.

  Returns:
    The updated cache, same shape and dtype.
  """
  with jax.named_scope("jaxkv.write_kv"):
    layout = _validate(cache, kv, slot_mapping, layout, block_size)
    config = config if config is not None else get_config(layout)
    if backend is None:
      backend = config.backend
      if _row_split(cache, layout) is None:
        backend = "xla"  # the kernel cannot tile these rows
    if backend not in BACKENDS:
      raise ValueError(f"{backend=} must be one of {BACKENDS}")
    if backend == "pallas" and _row_split(cache, layout) is None:
      raise ValueError(
          f"backend='pallas' needs a row of {cache.dtype=} and {cache.shape=}"
          f" ({layout=}) after the N axis to be a multiple of 16 bytes of at"
          " most 64K elements; use backend='xla'"
      )
    if kv.shape[0] == 0:
      return cache
    interpret = resolve_interpret(interpret) if backend == "pallas" else None
    if backend == "pallas" and interpret is None:
      require_kernel_device("write_kv", "backend='xla'")
    return _write(
        cache,
        kv,
        slot_mapping,
        layout=layout,
        backend=backend,
        config=config,
        interpret=interpret,
    )


def _validate(cache, kv, slot_mapping, layout, block_size) -> str:
  if layout is None:
    if cache.ndim not in _DEFAULT_LAYOUT:
      raise ValueError(
          f"{cache.shape=} must have rank 3 (BNC), 4 (BNHC) or 5 (LBNHC)"
          " unless layout is given"
      )
    layout = _DEFAULT_LAYOUT[cache.ndim]
  check_layout(layout)
  if cache.ndim != len(layout) or 0 in cache.shape:
    raise ValueError(f"{cache.shape=} must be non-empty with one axis per letter of {layout=}")
  n = cache.shape[layout.index("N")]
  num_blocks = cache.shape[layout.index("B")]
  if block_size is not None:
    if block_size <= 0 or block_size % n or num_blocks % (block_size // n):
      raise ValueError(
          f"{block_size=} must be a positive multiple of the slot extent {n}"
          f" that divides the {num_blocks} kernel blocks into logical blocks"
          f" ({cache.shape=}, {layout=})"
      )
  if kv.dtype != cache.dtype:
    raise ValueError(f"{kv.dtype=} must equal {cache.dtype=}")
  if slot_mapping.dtype != jnp.int32 or slot_mapping.ndim != 1:
    raise ValueError(f"{slot_mapping.shape=} {slot_mapping.dtype=} must be [tokens] int32")
  expected = (slot_mapping.shape[0], *kv_shape(cache.shape, layout))
  if kv.shape != expected:
    raise ValueError(
        f"{kv.shape=} must be [tokens, {', '.join(kv_axes(layout))}] = {expected}"
        f" for {cache.shape=} in {layout=} and {slot_mapping.shape=}"
    )
  if not isinstance(slot_mapping, jax.core.Tracer):
    _check_concrete_slots(np.asarray(slot_mapping), num_slots(cache.shape, layout))
  return layout


def _check_concrete_slots(slots: np.ndarray, total: int) -> None:
  bad = slots[slots >= total]
  if bad.size:
    raise ValueError(
        f"slot_mapping has slots {bad[:8].tolist()} >= num_slots={total}"
        " (num_blocks * block slots); the cache was not modified"
    )
  valid = slots[slots >= 0]
  uniq, counts = np.unique(valid, return_counts=True)
  if (counts > 1).any():
    raise ValueError(
        f"slot_mapping repeats slots {uniq[counts > 1][:8].tolist()}; each"
        " slot may be written by one token per call"
    )


def _row_split(cache, layout: str) -> tuple[int, int] | None:
  post = layout[layout.index("N") + 1 :]
  width = math.prod(cache.shape[layout.index(a)] for a in post)
  itemsize = jnp.dtype(cache.dtype).itemsize
  if itemsize not in _kernel.UINT_OF_SIZE:
    return None
  return _kernel.row_split(width, itemsize)


def _transpose_kv(kv, src: str, dst: str):
  perm = [src.index(a) for a in dst]
  return kv if perm == sorted(perm) else jnp.transpose(kv, perm)


@functools.partial(
    jax.jit,
    static_argnames=("layout", "backend", "config", "interpret"),
    donate_argnums=0,
)
def _write(cache, kv, slots, *, layout, backend, config, interpret):
  if backend == "xla":
    return _write_xla(cache, kv, slots, layout)
  return _write_pallas(cache, kv, slots, layout, config, interpret)


def _write_xla(cache, kv, slots, layout: str):
  """A donated scatter; invalid slots index past the end and are dropped."""
  dims = dict(zip(layout, cache.shape))
  n, nb = dims["N"], dims["B"]
  total = nb * n
  valid = (slots >= 0) & (slots < total)
  src = "T" + kv_axes(layout)
  ib = layout.index("B")
  if layout.index("N") == ib + 1:
    # B and N adjacent: one slot axis, a free reshape.
    merged = cache.shape[:ib] + (total,) + cache.shape[ib + 2 :]
    index = (slice(None),) * ib + (jnp.where(valid, slots, total),)
    values = _transpose_kv(kv, src, layout.replace("BN", "T"))
    out = cache.reshape(merged).at[index].set(values, mode="drop", unique_indices=True)
    return out.reshape(cache.shape)
  block = jnp.where(valid, slots // n, nb)
  index = tuple(
      block if a == "B" else slots % n if a == "N" else slice(None) for a in layout
  )
  # Advanced indices separated by a slice put the token axis first.
  values = _transpose_kv(kv, src, "T" + "".join(a for a in layout if a not in "BN"))
  return cache.at[index].set(values, mode="drop", unique_indices=True)


def _write_pallas(cache, kv, slots, layout: str, config: WriteKVConfig, interpret):
  geometry = _kernel.RowGeometry.from_layout(cache.shape, layout)
  i_n = layout.index("N")
  q_axes = "".join(a for a in layout[:i_n] if a != "B")
  post = layout[i_n + 1 :]
  itemsize = jnp.dtype(cache.dtype).itemsize
  uint = _kernel.UINT_OF_SIZE[itemsize]
  r, k = _row_split(cache, layout)
  tokens = kv.shape[0]
  rows = _transpose_kv(kv, "T" + kv_axes(layout), "T" + q_axes + post)
  rows = lax.bitcast_convert_type(rows, uint).reshape(tokens, geometry.num_q, r, k)
  tpb, qpb = config.blocking(tokens, geometry.num_q, r * k * itemsize)
  pad = -tokens % tpb
  if pad:
    rows = jnp.pad(rows, ((0, pad), (0, 0), (0, 0), (0, 0)))
    slots = jnp.pad(slots, (0, pad), constant_values=-1)
  cache_rows = lax.bitcast_convert_type(cache, uint).reshape(-1, r, k)
  out = _kernel.launch(
      cache_rows,
      rows,
      slots,
      geometry=geometry,
      tokens_per_block=tpb,
      q_per_block=qpb,
      interpret=interpret,
  )
  return lax.bitcast_convert_type(out.reshape(cache.shape), cache.dtype)
