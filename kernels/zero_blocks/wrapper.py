"""zero_blocks: validation, the work plan (row runs) and the kernel launch."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Shaped

from jaxkv.kernels._common import require_kernel_device, resolve_interpret
from jaxkv.kernels.zero_blocks import kernel as _kernel
from jaxkv.kernels.zero_blocks.config import ZeroBlocksConfig, get_config
from jaxkv.kernels.zero_blocks.reference import block_geometry, check_layout

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class _Geometry:
  """The cache as `[p0, X, p2, Y, p4]` with `(X, Y) = (B, N)` or `(N, B)`.

  A row is `p4` consecutive elements: the bytes of one slot that are
  contiguous in memory. `b_outer` says whether B comes before N.
  """

  num_kblocks: int
  k: int
  r: int
  p0: int
  p2: int
  p4: int
  b_outer: bool

  @classmethod
  def of(cls, shape, layout, block_size):
    num_kblocks, k, r = block_geometry(shape, layout, block_size)
    i, j = sorted((layout.index("B"), layout.index("N")))
    return cls(
        num_kblocks, k, r,
        p0=math.prod(shape[:i]),
        p2=math.prod(shape[i + 1:j]),
        p4=math.prod(shape[j + 1:]),
        b_outer=layout.index("B") < layout.index("N"),
    )

  @property
  def num_rows(self) -> int:
    return self.p0 * self.num_kblocks * self.p2 * self.k

  def block_runs(self, ids):
    """Row runs `(first, count, max_count)` covering whole logical blocks.

    `first` has the id as its leading axis; `count` broadcasts against it.
    """
    bk, k, r, p2 = self.num_kblocks, self.k, self.r, self.p2
    if self.b_outer:  # one run per (id, p0): kernel blocks b*r.. are adjacent
      kb = _ax(ids, 2, 0) * r + _ax(_iota(self.p0), 2, 1) * bk
      return kb * p2 * k, r * p2 * k, r * p2 * k
    # N outer: per (id, p0, slot, p2), the r adjacent kernel blocks.
    return self._n_outer_base(ids), r, r

  def tail_runs(self, ids, valid):
    """Row runs of the slots at or past `valid` in logical blocks `ids`."""
    bk, k, r, p2 = self.num_kblocks, self.k, self.r, self.p2
    if self.b_outer and p2 == 1:  # the slots past `valid` are adjacent rows
      kb = _ax(ids, 2, 0) * r + _ax(_iota(self.p0), 2, 1) * bk
      v = _ax(valid, 2, 0)
      return kb * k + v, r * k - v, r * k
    if self.b_outer:  # per (id, kernel block j, p0, p2), the invalid slots
      j = _ax(_iota(r), 4, 1)
      kb = _ax(ids, 4, 0) * r + j + _ax(_iota(self.p0), 4, 2) * bk
      first = (kb * p2 + _ax(_iota(p2), 4, 3)) * k
      vj = jnp.clip(_ax(valid, 4, 0) - j * k, 0, k)
      return first + vj, k - vj, k
    # N outer: per (id, p0, slot t, p2), the kernel blocks from the first one
    # in which slot t is past `valid`.
    t = _ax(_iota(k), 4, 2)
    j0 = jnp.clip((_ax(valid, 4, 0) - t + k - 1) // k, 0, r)
    return self._n_outer_base(ids) + j0, r - j0, r

  def _n_outer_base(self, ids):
    """`[ids, p0, k, p2]` row of kernel block `id * r` for each (p0, t, p2)."""
    k, p2 = self.k, self.p2
    outer = (_ax(_iota(self.p0), 4, 1) * k + _ax(_iota(k), 4, 2)) * p2
    outer = (outer + _ax(_iota(p2), 4, 3)) * self.num_kblocks
    return outer + _ax(ids, 4, 0) * self.r


def _iota(n):
  return jnp.arange(n, dtype=jnp.int32)


def _ax(x, ndim, axis):
  """Reshapes 1-D `x` to rank `ndim`, its values along `axis`."""
  shape = [1] * ndim
  shape[axis] = x.shape[0]
  return x.reshape(shape)


def _pieces(first, count, max_count, ok, item_rows, scale):
  """Flattens runs to `[n, 2]` items, splitting runs longer than item_rows.

  Runs are given in slot rows and returned in view rows (`scale` per slot),
  with the most rows an item may hold (a static int).
  """
  first, count = jnp.broadcast_arrays(first, jnp.asarray(count, jnp.int32))
  first, count, max_count = first * scale, count * scale, max_count * scale
  ok = _ax(ok, first.ndim, 0)
  count = jnp.where(ok, count, 0).reshape(-1)
  first = jnp.where(ok, first, 0).reshape(-1)
  n = pl.cdiv(max_count, item_rows)
  if n > 1:
    q = jnp.arange(n, dtype=jnp.int32).reshape(1, n) * item_rows
    first = (first[:, None] + q).reshape(-1)
    count = jnp.clip(count[:, None] - q, 0, item_rows).reshape(-1)
  return jnp.stack([first, count], axis=1).astype(jnp.int32), min(max_count, item_rows)


def _scatter_zeros(rows, items, item_rows: int):
  """The kernel's work as one XLA scatter: zeros into the `count` rows from
  `first` of each item (`[n, 2]`, at most `item_rows` rows each) and no
  other; in place where the cache is donated."""
  offsets = jnp.arange(item_rows, dtype=jnp.int32)[None, :]
  idx = jnp.where(offsets < items[:, 1:], items[:, :1] + offsets, rows.shape[0])
  return rows.at[idx.reshape(-1)].set(jnp.zeros((), rows.dtype), mode="drop")


def _as_int_array(x, name):
  x = x if isinstance(x, jax.Array) else np.asarray(x)
  if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be a 1-D integer array, got {name}.shape="
                     f"{x.shape} {name}.dtype={x.dtype}")
  return x


def _check_concrete(x, name, lo, hi):
  """Range check where the values are known now (not traced)."""
  if isinstance(x, jax.core.Tracer):
    return
  v = np.asarray(x)
  bad = (v < lo) | (v > hi)
  if bad.any():
    raise ValueError(
        f"{name} must be in [{lo}, {hi}], got {name}[{int(np.argmax(bad))}]="
        f"{int(v[np.argmax(bad)])}"
    )


def _unit_dtype(dtype) -> np.dtype:
  return np.dtype(f"uint{8 * min(dtype.itemsize, 4)}")


def _to_rows(cache, width, unit):
  words = jax.lax.bitcast_convert_type(cache, unit)
  return words.reshape(-1, width)


def _from_rows(rows, shape, dtype):
  e, u = dtype.itemsize, rows.dtype.itemsize
  if e > u:
    rows = rows.reshape(-1, e // u)
  return jax.lax.bitcast_convert_type(rows, dtype).reshape(shape)


def _view_width(row_units: int, unit: np.dtype) -> int:
  """Elements per view row: one TMA box row, contiguous, <= 256 elements.

  A slot row of `row_units` elements is split into `row_units // width` view
  rows; `width * itemsize` must be a multiple of 16 bytes for TMA.
  """
  g = 16 // math.gcd(16, unit.itemsize)
  return max(d for d in range(g, min(row_units, 256) + 1, g) if row_units % d == 0)


def _launch(rows, items, cfg, interpret, *, tma: bool):
  """Runs the kernel on `rows` (aliased) and returns the updated rows."""
  num_ctas = max(1, min(cfg.num_ctas, items.shape[0]))
  width = rows.shape[1]
  unit = rows.dtype
  if tma:
    tile_rows = min(cfg.rows_per_tile(width * unit.itemsize),
                    1 << (rows.shape[0].bit_length() - 1))
    body = functools.partial(_kernel.zero_rows_tma_kernel, prefetch=cfg.prefetch)
    scratch = [plgpu.SMEM((tile_rows, width), unit)]
    target = rows
  else:
    body = functools.partial(_kernel.zero_rows_regs_kernel, row_width=width,
                             prefetch=cfg.prefetch)
    scratch = []
    target = rows.reshape(-1)
  call = plgpu.kernel(
      body, out_type=(), grid=(num_ctas,), grid_names=("cta",),
      scratch_types=scratch, interpret=interpret,
      kernel_name="jaxkv_zero_blocks",
  )

  def stateful(refs):
    items_ref, target_ref = refs
    call(items_ref, target_ref)

  _, out = pl.run_state(stateful)((items, target))
  return out.reshape(rows.shape)


def zero_blocks(
    cache: Shaped[Array, "..."] | Shaped[np.ndarray, "..."],
    block_ids: Any,
    *,
    layout: str = "LBNHC",
    block_size: int | None = None,
    tails: Any = None,
    interpret: Any = None,
    config: ZeroBlocksConfig | None = None,
) -> Shaped[Array, "..."]:
  """Zeroes whole logical blocks and block tails of a paged cache in one launch.

  The cache is updated in place (the kernel aliases it; donate it under jit to
  avoid a copy); blocks not named are neither read nor written. Works inside
  jit with traced `block_ids` and `tails`: traced ids outside
  `[0, num_logical_blocks)` are treated as -1 padding and traced valid counts
  are clipped to `[0, block_size]`, so nothing outside the named blocks is
  ever written. Concrete inputs are range-checked.

  Args:
    cache: the cache in kernel-block units, axes in `layout` order: its B axis
      counts kernel blocks and its N extent is the kernel block size. Any
      dtype; zeroing is byte-exact. A NumPy array is copied to the device.
    block_ids: `[ids]` int logical block ids to zero whole; -1 is padding;
      duplicates are fine.
    layout: physical axis order, a permutation of B, N, C with optional L, H
      (`"LBNHC"`, `"LBHNC"`, `"LHBNC"`, `"BLHNC"`, `"BLNHC"`, `"BHLNC"`,
      `"BNC"`, `"BNHC"`, ...).
    block_size: logical block size in slots, a multiple of the N extent
      (default: the N extent); logical block `b` is kernel blocks
      `[b*r, (b+1)*r)` with `r = block_size // N`.
    tails: optional `(tail_ids [tails], valid_slots [tails])`: for each logical
      block id (-1 padding) zero the slots at or past `valid_slots`.
    interpret: `None`, `True`, `False` or a `plgpu.InterpretGPUParams`.
    config: tuning override; default from the tuned JSON or the heuristic. A
      compiled call runs `config.implementation`: the kernel needs a Hopper
      GPU (a `ValueError` names any other device); "xla" (a scatter of the
      same zeros) runs anywhere and is the default on other GPUs.

  Returns:
    The cache (same shape and dtype) with exactly those slots zeroed.
  """
  with jax.named_scope("jaxkv.zero_blocks"):
    cache = jnp.asarray(cache)
    layout = check_layout(layout, cache.shape)
    geo = _Geometry.of(cache.shape, layout, block_size)
    nlb = geo.num_kblocks // geo.r
    block_ids = _as_int_array(block_ids, "block_ids")
    _check_concrete(block_ids, "block_ids", -1, nlb - 1)
    if tails is None:
      tails = (np.zeros((0,), np.int32), np.zeros((0,), np.int32))
    if not isinstance(tails, (tuple, list)) or len(tails) != 2:
      raise ValueError("tails must be a pair (tail_ids, valid_slots) or None")
    tail_ids = _as_int_array(tails[0], "tails[0] (tail ids)")
    valid = _as_int_array(tails[1], "tails[1] (valid_slots)")
    if tail_ids.shape != valid.shape:
      raise ValueError(f"tail ids and valid_slots differ in shape: "
                       f"{tail_ids.shape=} {valid.shape=}")
    _check_concrete(tail_ids, "tails[0] (tail ids)", -1, nlb - 1)
    _check_concrete(valid, "tails[1] (valid_slots)", 0, geo.r * geo.k)
    if block_ids.shape[0] == 0 and tail_ids.shape[0] == 0:
      return cache
    if cache.size == 0:
      return cache
    row_bytes = geo.p4 * cache.dtype.itemsize
    unit = _unit_dtype(cache.dtype)
    width = row_bytes // unit.itemsize
    if geo.num_rows * max(width, 1) > _INT32_MAX:
      raise ValueError(f"cache.shape={cache.shape} has more than 2**31 words.")
    cfg = config or get_config(row_bytes)
    tma = row_bytes % 16 == 0
    # TMA views a slot row as `scale` contiguous rows of at most 256 elements.
    view_width = _view_width(width, unit) if tma else width
    scale = width // view_width

    ids = jnp.asarray(block_ids, jnp.int32)
    tids = jnp.asarray(tail_ids, jnp.int32)
    vals = jnp.clip(jnp.asarray(valid, jnp.int32), 0, geo.r * geo.k)
    parts = []
    if ids.shape[0]:
      parts.append(_pieces(*geo.block_runs(ids), (ids >= 0) & (ids < nlb),
                           cfg.item_rows, scale))
    if tids.shape[0]:
      parts.append(_pieces(*geo.tail_runs(tids, vals), (tids >= 0) & (tids < nlb),
                           cfg.item_rows, scale))
    items = jnp.concatenate([p for p, _ in parts], axis=0)
    rows = _to_rows(cache, view_width, unit)
    interpret = resolve_interpret(interpret)
    if interpret is None and cfg.implementation == "xla":
      out = _scatter_zeros(rows, items, max(n for _, n in parts))
    else:
      if interpret is None:
        require_kernel_device("zero_blocks", "config=ZeroBlocksConfig(implementation='xla')")
      out = _launch(rows, items, cfg, interpret, tma=tma)
    return _from_rows(out, cache.shape, cache.dtype)
