"""Capture as jit tracing: compile a step per padded batch size, warm up, reset the null block.

A serving engine captures one CUDA graph per padded batch size and replays it.
In JAX the same lifecycle is ahead-of-time compilation (`jit(...).lower(...)
.compile()`) of the step for each size, a warm-up call on a dummy batch, and an
explicit reset of the null block afterwards: anything the warm-up wrote into
block 0 (a component that derives write slots from the all-zero block table)
would otherwise be read by every later padded row.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ._null_block import reset_null_block

# What a padded row holds: tables point at the null block, slot mappings and
# sparse indices are -1 (nothing written, nothing read), lengths are 0.
DEFAULT_PAD_VALUES: Mapping[str, int] = {
    "block_table": 0,
    "slot_mapping": -1,
    "indices": -1,
    "seq_lens": 0,
}

Batch = Mapping[str, jax.Array]


def _pad_value(pad_values: Mapping[str, int], key: str) -> int:
  return pad_values.get(key, 0)


def dummy_batch(example: Mapping[str, Any], size: int, pad_values: Mapping[str, int] = DEFAULT_PAD_VALUES) -> dict[str, jax.Array]:
  """A batch of `size` padded rows shaped like `example` (all-zero tables, -1 slots, zero lengths)."""
  return {
      k: jnp.full((size, *v.shape[1:]), _pad_value(pad_values, k), v.dtype) for k, v in example.items()
  }


def pad_batch(batch: Batch, size: int, pad_values: Mapping[str, int] = DEFAULT_PAD_VALUES) -> dict[str, jax.Array]:
  """Appends padded rows to every array of `batch` up to `size` rows."""
  out = {}
  for k, v in batch.items():
    extra = size - v.shape[0]
    if extra < 0:
      raise ValueError(f"batch[{k!r}] has {v.shape[0]} rows, more than {size=}")
    fill = jnp.full((extra, *v.shape[1:]), _pad_value(pad_values, k), v.dtype)
    out[k] = jnp.concatenate([v, fill]) if extra else v
  return out


def _struct(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


@dataclasses.dataclass(frozen=True)
class CapturedStep:
  """Compiled steps by padded batch size; calling it pads, replays and unpads.

  Attributes:
    batch_sizes: the captured sizes, ascending.
    executables: the compiled step of each size.
    example: shapes/dtypes (per row) that a batch must match.
    pad_values: the padding of each batch entry (default 0).
  """

  batch_sizes: tuple[int, ...]
  executables: Mapping[int, Any]
  example: Mapping[str, jax.ShapeDtypeStruct]
  pad_values: Mapping[str, int]

  def size_for(self, rows: int) -> int:
    i = bisect.bisect_left(self.batch_sizes, rows)
    if rows < 1 or i == len(self.batch_sizes):
      raise ValueError(f"a batch of {rows} rows fits no captured size {self.batch_sizes}")
    return self.batch_sizes[i]

  def __call__(self, cache, batch: Batch):
    """Runs the captured step on `batch` padded to the nearest captured size.

    Args:
      cache: the cache pytree; it is donated (do not reuse the argument).
      batch: the real rows, keyed like the example batch of `capture`.

    Returns:
      `(cache, out)`, `out` cut back to the real rows.
    """
    if set(batch) != set(self.example):
      raise ValueError(f"batch keys {sorted(batch)} differ from the captured {sorted(self.example)}")
    rows = {v.shape[0] for v in batch.values()}
    if len(rows) != 1:
      raise ValueError(f"batch entries disagree on the number of rows: { {k: v.shape for k, v in batch.items()} }")
    for k, v in batch.items():
      want = self.example[k]
      if v.shape[1:] != want.shape[1:] or v.dtype != want.dtype:
        raise ValueError(f"batch[{k!r}]: {v.shape=} {v.dtype=}, expected [rows, *{want.shape[1:]}] {want.dtype}")
    (real,) = rows
    size = self.size_for(real)
    cache, out = self.executables[size](cache, pad_batch(batch, size, self.pad_values))
    return cache, jax.tree.map(lambda x: x[:real], out)


def capture(
    step_fn: Callable,
    cache,
    batch_sizes,
    example_batch: Batch,
    *,
    pad_values: Mapping[str, int] = DEFAULT_PAD_VALUES,
    layout: str = "BNC",
    block_size: int | None = None,
    reset: Callable | None = None,
    interpret=None,
):
  """Compiles `step_fn` for each padded batch size, warms each up, then resets the null block.

  Args:
    step_fn: `(cache, batch) -> (cache, out)`, jittable; every leaf of `batch`
      and `out` has the batch as its leading axis. The cache is donated.
    cache: the cache pytree (donated: use the returned one).
    batch_sizes: the padded batch sizes to capture.
    example_batch: a batch (any number of rows) fixing keys, trailing shapes and
      dtypes.
    pad_values: what a padded row holds, per key (default 0).
    layout, block_size: the layout of every cache leaf, for the null-block reset.
    reset: replaces the default reset (`reset_null_block` on every leaf).
    interpret: passed to the reset kernel.

  Returns:
    `(captured, cache)`: the callable that replays the compiled steps, and the
    cache after warm-up with its null block reset.
  """
  sizes = tuple(sorted(set(int(s) for s in batch_sizes)))
  if not sizes or sizes[0] < 1:
    raise ValueError(f"batch_sizes={batch_sizes!r} must be positive ints")
  example = {k: jax.ShapeDtypeStruct((1, *v.shape[1:]), v.dtype) for k, v in example_batch.items()}
  cache_structs = jax.tree.map(_struct, cache)
  step = jax.jit(step_fn, donate_argnums=0)
  executables = {}
  with jax.named_scope("jaxkv.capture"):
    for size in sizes:
      batch_structs = {k: jax.ShapeDtypeStruct((size, *v.shape[1:]), v.dtype) for k, v in example.items()}
      executables[size] = step.lower(cache_structs, batch_structs).compile()
    for size in sizes:
      cache, _ = executables[size](cache, dummy_batch(example, size, pad_values))
    if reset is None:
      cache = jax.tree.map(
          lambda c: reset_null_block(c, layout=layout, block_size=block_size, interpret=interpret), cache
      )
    else:
      cache = reset(cache)
  return CapturedStep(sizes, executables, example, dict(pad_values)), cache
