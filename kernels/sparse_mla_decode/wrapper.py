"""sparse_mla_decode: validates a top-k decode, launches the kernel, merges its splits."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Shaped

from jaxkv._types import BATCH, HEADS, MLA_HEAD_DIM, MLA_LATENT_DIM, Lse
from jaxkv.kernels._common import (
    check_sm_scale,
    require_interpreter_threads,
    require_kernel_device,
    resolve_interpret,
)
from jaxkv.kernels.mla_decode.combine import combine_splits
from jaxkv.kernels.mla_decode.layout import (
    HEAD_TILE,
    NUM_THREADS,
    query_rows,
    real_heads,
    unscaled,
)
from jaxkv.kernels.sparse_mla_decode import kernel as _kernel
from jaxkv.kernels.sparse_mla_decode.config import TILE, SparseMLADecodeConfig, default_config
from jaxkv.kernels.sparse_mla_decode.plan import (
    cluster_ctas,
    merged_after_kernel,
    merges_in_cluster,
    rows_to_cut,
    stream_schedule,
)
from jaxkv.kernels.sparse_mla_decode.piece_merge import build_piece_merge
from jaxkv.kernels.sparse_mla_decode.reference import MASK_MODES, sparse_mla_decode_reference

TOPK_MULTIPLE = 64
MAX_TOPK = 2048
MAX_HEADS = 128


def sparse_mla_decode(
    q: Shaped[Array, "..."],
    cache: Shaped[Array, "..."],
    indices: Shaped[Array, "..."],
    *,
    sm_scale: float,
    dv: int = 512,
    mask_mode: str = "select",
    config: SparseMLADecodeConfig | None = None,
    interpret: Any = None,
) -> tuple[Float[Array, f"{BATCH} {HEADS} dv"], Lse]:
  """DeepSeek sparse-attention decode: each row attends to its top-k cache slots.

  (Inputs are annotated loosely so that bad shapes reach the ValueError checks.)

  Semantics are those of `sparse_mla_decode_reference`: `-1` entries (and
  any id outside the cache, which is never clamped onto another slot) get
  probability 0; "multiply" clamps them to slot 0 (the null block) and still
  accumulates its value row, "select" never lets them reach the accumulator
  (the kernel reads nothing for them: no slot outside the selection is
  read); duplicates count as
  often as they appear; a row without a valid entry gives `out` 0 and `lse`
  -inf; a NaN in a valid entry's slot or a head's query gives NaN `out` and
  `lse` at the heads it reaches, whichever splits, pieces or merge the call
  runs; a batch of 0 rows gets empty results, with nothing launched. Works
  under `jax.jit` with traced indices.

  Args:
    q: `[batch, heads, 576]` bf16 or float32 queries (1 to 128 heads; cast to
      bf16 for the tensor cores). Heads are computed in groups of 64: a
      multiple of 8 goes in as it is, other counts are padded to the group
      in XLA (and, except for one split's bf16 result, the result is sliced).
    cache: `[num_blocks, block_size, 576]` bf16 latent cache.
    indices: `[batch, topk]` int32 global slot ids (`block * block_size +
      offset`), -1 (or any id outside `[0, num_blocks * block_size)`)
      invalid; topk a multiple of 64, at most 2048.
    sm_scale: scale of the logits `q . k`.
    dv: value channels; the kernel supports 512.
    mask_mode: "select" (NaN-safe) or "multiply" (like production kernels).
    config: launch parameters; default the tuned config of this device kind.
    interpret: see `jaxkv.kernels._common.resolve_interpret`. A compiled
      call runs `config.implementation` (the Pallas kernel by default, see
      `SparseMLADecodeConfig`); an interpreted one runs the Pallas kernel.

  Returns:
    `out` `[batch, heads, dv]` in q's dtype and `lse` `[batch, heads]`
    float32 (natural log).
  """
  with jax.named_scope("jaxkv.sparse_mla_decode"):
    _validate(q, cache, indices, sm_scale, dv, mask_mode, config)
    batch, heads, _ = q.shape
    if batch == 0:  # a step without decode rows: nothing to read or launch
      return jnp.zeros((0, heads, dv), q.dtype), jnp.zeros((0, heads), jnp.float32)
    topk = indices.shape[1]
    if config is None:
      config = default_config(batch=batch, num_heads=heads, topk=topk)
    if topk % (TILE * config.num_splits):
      raise ValueError(
          f"{config.num_splits=} must divide {topk=} into multiples of"
          f" {TILE} indices"
      )
    cut = rows_to_cut(config, batch=batch, num_heads=heads, topk=topk)
    if cut.rows and (cut.rows > batch or topk < cut.pieces * TILE):
      raise ValueError(
          f"{config.cut_rows=} must be at most batch = {batch}, with topk = {topk} of at"
          f" least {cut.pieces} x {TILE} indices ({cut.pieces} pieces of a tile or"
          f" more; {config.pieces=})"
      )
    if cut.parts > batch:
      raise ValueError(
          f"{config.parts=} must be at most batch = {batch} (each part at least a row long)")
    cluster_merge = merges_in_cluster(config, batch=batch, num_heads=heads, cut=cut)
    interpret = resolve_interpret(interpret)
    if interpret is not None:
      # The interpreter runs all the CTAs of a cluster at once (a cut row's
      # halves: two).
      cluster = cluster_ctas(num_splits=config.num_splits, cut_rows=cut.rows,
                             cluster_merge=cluster_merge)
      require_interpreter_threads(NUM_THREADS * cluster, "sparse_mla_decode")
    if interpret is None and config.implementation == "xla":
      return _reference(q, cache, indices, sm_scale=float(sm_scale), dv=dv, mask_mode=mask_mode)
    if interpret is None:
      require_kernel_device(
          "sparse_mla_decode", "config=SparseMLADecodeConfig(implementation='xla')")
    return _sparse_mla_decode(
        q,
        cache,
        indices,
        sm_scale=float(sm_scale),
        select=mask_mode == "select",
        num_splits=config.num_splits,
        interpret=interpret,
        q_regs=config.q_regs,
        kv_swizzle=config.kv_swizzle,
        stage_out=config.stage_out,
        cut_rows=cut.rows,
        pieces=cut.pieces,
        cluster_merge=cluster_merge,
        xla_combine=config.combine == "xla",
        parts=cut.parts,
        stream_whole=config.stream_whole,
        stream_segment=config.stream_segment,
        f16_partials=config.f16_partials and merged_after_kernel(
            config, cut=cut, in_clusters=cluster_merge),
    )


def _validate(q, cache, indices, sm_scale, dv, mask_mode, config) -> None:
  check_sm_scale(sm_scale)
  if config is not None and not isinstance(config, SparseMLADecodeConfig):
    raise ValueError(f"config must be a SparseMLADecodeConfig, got {type(config)}")
  if mask_mode not in MASK_MODES:
    raise ValueError(f"{mask_mode=} must be one of {MASK_MODES}")
  if dv != MLA_LATENT_DIM:
    raise ValueError(f"{dv=} must be {MLA_LATENT_DIM} (the latent channels)")
  if q.ndim != 3 or q.shape[-1] != MLA_HEAD_DIM or q.dtype not in (
      jnp.bfloat16, jnp.float32
  ):
    raise ValueError(
        f"{q.shape=} {q.dtype=} must be [batch, heads, {MLA_HEAD_DIM}] bf16/f32"
    )
  if not 1 <= q.shape[1] <= MAX_HEADS:
    raise ValueError(f"{q.shape=} must have 1 to {MAX_HEADS} heads")
  if cache.ndim != 3 or cache.shape[-1] != MLA_HEAD_DIM or cache.dtype != jnp.bfloat16:
    raise ValueError(
        f"{cache.shape=} {cache.dtype=} must be [num_blocks, block_size,"
        f" {MLA_HEAD_DIM}] bf16"
    )
  if cache.shape[0] < 1 or cache.shape[1] < 1:
    raise ValueError(f"{cache.shape=} must have at least one block and slot")
  if indices.ndim != 2 or indices.dtype != jnp.int32 or indices.shape[0] != q.shape[0]:
    raise ValueError(
        f"{indices.shape=} {indices.dtype=} must be [batch, topk] int32 with"
        f" batch = {q.shape[0]} ({q.shape=})"
    )
  topk = indices.shape[1]
  if topk == 0 or topk % TOPK_MULTIPLE or topk > MAX_TOPK:
    raise ValueError(
        f"{indices.shape=}: topk must be a positive multiple of {TOPK_MULTIPLE}"
        f" of at most {MAX_TOPK} (pad with -1)"
    )


_reference = jax.jit(sparse_mla_decode_reference, static_argnames=("sm_scale", "dv", "mask_mode"))


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "select", "num_splits", "interpret", "q_regs", "stage_out",
                     "pad_heads", "cut_rows", "pieces", "cluster_merge", "xla_combine",
                     "parts", "stream_whole", "stream_segment", "f16_partials",
                     "kv_swizzle"),
)
def _sparse_mla_decode(
    q, cache, indices, *, sm_scale, select, num_splits, interpret, q_regs, stage_out,
    pad_heads=False, cut_rows=0, pieces=2, cluster_merge=False, xla_combine=False, parts=0,
    f16_partials=False, kv_swizzle=128, stream_whole=None, stream_segment=None,
):
  batch, heads, _ = q.shape
  heads_padded = -(-heads // HEAD_TILE) * HEAD_TILE
  qp = q.astype(jnp.bfloat16)
  # A multiple of 8 heads goes in unpadded (as in dense decode: no XLA pad,
  # and with one split and a staged bf16 result, no slice); `pad_heads` pads
  # every count, as before (the benchmark's A/B).
  q_heads = query_rows(heads, pad=pad_heads)
  if q_heads != heads:
    qp = jnp.pad(qp, ((0, 0), (0, heads_padded - heads), (0, 0)))
  rows = cache.reshape(-1, MLA_HEAD_DIM)
  tiles = indices.shape[1] // TILE
  # The stream: whole rows per part before its leftover run, and a row
  # segment's cost in tiles, by which the leftover runs are cut.
  stream = stream_schedule(stream_whole, stream_segment, batch=batch, num_heads=heads,
                           tiles=tiles, parts=parts) if parts else None
  call = _kernel.build_kernel(
      batch=batch,
      heads_padded=heads_padded,
      topk=indices.shape[1],
      num_splits=num_splits,
      sm_scale=sm_scale,
      select=select,
      interpret=interpret,
      out_dtype=q.dtype,
      q_regs=q_regs,
      kv_swizzle=kv_swizzle,
      stage_out=stage_out,
      q_heads=q_heads,
      cut_rows=cut_rows,
      pieces=pieces,
      cluster_merge=cluster_merge,
      parts=parts,
      stream_whole=stream.whole if stream else 0,
      stream_segment=stream.segment_cost if stream else 0,
      f16_partials=f16_partials,
  )
  o, lse, *more = call(qp, rows, indices)
  # With f16_partials the partials are float16 bits and their scales (one
  # output more): the merge kernel reads them as they are, XLA's combine
  # unscaled.
  scaled = dict(scaled=f16_partials)
  if cluster_merge:  # the clusters merged the splits or halves: [b, heads or hp, 512], [b, ...]
    return real_heads(o, lse, heads)
  if parts:
    # The leftover rows' pieces ([left_rows, max_pieces, hp, 512],
    # [left_rows, max_pieces, hp] f32, `Stream.row_pieces` of each), merged
    # into the rows the kernel left unwritten; a row in one piece was written.
    if not stream.cut_rows:
      return real_heads(o, lse, heads)
    if xla_combine:
      counts = np.array([stream.row_pieces(i) for i in range(stream.left_rows)])
      keep = np.flatnonzero(counts > 1)
      present = np.arange(more[0].shape[1]) < counts[keep, None]
      return _combine_in_xla(o, lse, more, heads=heads, select=select, keep=keep,
                             at=stream.first_left_row + keep, present=present)
    merge = build_piece_merge(
        rows=stream.left_rows, pieces=more[0].shape[1], heads_padded=heads_padded,
        out_heads=o.shape[1], out_dtype=o.dtype, select=select, interpret=interpret,
        first_row=stream.first_left_row, stream=stream, q_heads=q_heads, **scaled)
    return real_heads(*merge(*more, o, lse), heads)
  if num_splits == 1:  # the kernel wrote the result: [b, heads or hp, 512], [b, ...]
    if not cut_rows:
      return real_heads(o, lse, heads)
    # The last rows' pieces ([cut_rows, pieces, hp, 512], [cut_rows, pieces,
    # hp] f32), merged into the rows the kernel left unwritten.
    if xla_combine:
      return _combine_in_xla(o, lse, more, heads=heads, select=select,
                             at=slice(batch - cut_rows, None))
    merge = build_piece_merge(
        rows=cut_rows, pieces=pieces, heads_padded=heads_padded, out_heads=o.shape[1],
        out_dtype=o.dtype, select=select, interpret=interpret, first_row=batch - cut_rows,
        **scaled)
    return real_heads(*merge(*more, o, lse), heads)
  # Each split's partial result: [b, s, hp, 512] f32, [b, s, hp] f32. In
  # "multiply", a split of -1s only that met a NaN null block poisons its
  # row, as in production kernels' merge.
  if xla_combine:
    if f16_partials:
      o = unscaled(o, *more)
    out, lse = combine_splits(o[:, :, :heads], lse[:, :, :heads], empty_nan=not select)
    return out.astype(q.dtype), lse
  merge = build_piece_merge(rows=batch, pieces=num_splits, heads_padded=heads_padded,
                            out_heads=q_heads, out_dtype=q.dtype, select=select,
                            interpret=interpret, **scaled)
  return real_heads(*merge(o, lse, *more), heads)


def _combine_in_xla(o, lse, more, *, heads, select, at, keep=slice(None), present=None):
  """The cut rows' pieces (`more`: `[cuts, pieces, hp, 512]` and `[cuts,
  pieces, hp]`, and float16 pieces' scales; those at `keep`) merged by
  `combine_splits` and updated into the kernel's result at rows `at` (a
  slice: the last rows; an index array: the stream's cut rows)
  (`SparseMLADecodeConfig.combine="xla"`). `present`: None, or a `[rows
  kept, pieces]` bool array, False for a slot that holds no piece (the
  stream's rows of fewer pieces than the most): never used."""
  out, lse = real_heads(o, lse, heads)
  pieces = more[0] if len(more) == 2 else unscaled(more[0], more[2])
  cut_o, cut_lse = pieces[keep, :, :heads], more[1][keep, :, :heads]
  if present is not None:
    cut_o = jnp.where(present[:, :, None, None], cut_o, 0.0)
    cut_lse = jnp.where(present[:, :, None], cut_lse, -jnp.inf)
  cut_o, cut_lse = combine_splits(cut_o, cut_lse, empty_nan=not select)
  # Updated in place. The barrier keeps XLA's GPU dynamic-slice fusion
  # from taking the kernel's call into the update of its own output, where
  # it finds a cycle and fails (jax 0.11.2). Slices and a concatenation in
  # place of the update were correct but 1-11 µs slower on the H200.
  out, lse = lax.optimization_barrier((out, lse))
  return out.at[at].set(cut_o.astype(out.dtype)), lse.at[at].set(cut_lse)
