"""NaN in the data a row reads as valid (a head's query, a written slot, a
selected slot) is data, not garbage: the references and every kernel path
give that head NaN out and NaN LSE, whatever the split plan, schedule or
merge, and leave the other heads and rows as they would be. (NaN in slots a
row must not read is the other tests' subject: "select" never lets it in.)"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kernels.mla_decode import combine_splits
from jaxkv.kernels.sparse_mla_decode import (
    SparseMLADecodeConfig,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)

import mla_problem as dense
from sparse_problem import FAST, SCALE

NAN_HEAD = 5  # the head whose query holds a NaN


def nan_mask(batch, heads, slot_row, q_row):
  """The heads that must come out NaN: every head of `slot_row` (a NaN in a
  slot it reads as valid reaches every head's scores), and `NAN_HEAD` of
  `q_row` (a NaN in that head's query)."""
  mask = np.zeros((batch, heads), bool)
  mask[slot_row] = True
  mask[q_row, NAN_HEAD] = True
  return mask


def check_nan_heads(got, want, mask):
  """`got` has NaN out and LSE at exactly `mask`'s heads, as `want` (the
  reference) has, and is close to it everywhere else."""
  out, lse = (np.asarray(x, np.float32) for x in got)
  ref_out, ref_lse = (np.asarray(x, np.float32) for x in want)
  # The reference itself: NaN there and nowhere else (so this cannot pass
  # on a problem that never met its NaN).
  np.testing.assert_array_equal(np.isnan(ref_lse), mask)
  np.testing.assert_array_equal(np.isnan(ref_out).all(axis=-1), mask)
  np.testing.assert_array_equal(np.isnan(ref_out).any(axis=-1), mask)
  np.testing.assert_array_equal(np.isnan(lse), mask)
  np.testing.assert_array_equal(np.isnan(out).all(axis=-1), mask)
  np.testing.assert_array_equal(np.isnan(out).any(axis=-1), mask)
  ok = ~mask
  err = np.linalg.norm(out[ok] - ref_out[ok]) / np.linalg.norm(ref_out[ok])
  assert err < 1e-2, err
  np.testing.assert_allclose(lse[ok], ref_lse[ok], rtol=1e-3, atol=1e-3)


def test_combine_splits_propagates_a_nan_lse():
  """A live split whose LSE is NaN makes its row's head NaN; a dead split
  (-inf) still has weight 0 whatever its `o` holds; all dead: 0 and -inf."""
  rng = np.random.default_rng(5)
  o = jnp.asarray(rng.standard_normal((3, 3, 4, 8)), jnp.float32)
  lse = jnp.asarray(rng.standard_normal((3, 3, 4)), jnp.float32)
  lse = lse.at[0, 1, 2].set(jnp.nan).at[1, 0].set(-jnp.inf).at[2].set(-jnp.inf)
  o = o.at[0, 1, 2].set(jnp.nan).at[1, 0].set(jnp.nan).at[2].set(jnp.nan)
  for splits in (slice(None), slice(1, 2)):  # several splits; the one-split shortcut
    out, lse_out = (np.asarray(x) for x in combine_splits(o[:, splits], lse[:, splits]))
    want = np.zeros((3, 4), bool)
    want[0, 2] = True
    np.testing.assert_array_equal(np.isnan(lse_out), want)
    np.testing.assert_array_equal(np.isnan(out).all(axis=-1), want)
    np.testing.assert_array_equal(np.isnan(out).any(axis=-1), want)
    assert (out[2] == 0).all() and (lse_out[2] == -np.inf).all()
  # The dead split of row 1 dropped, the others merged as without it.
  out, lse_out = combine_splits(o, lse)
  ref, ref_lse = combine_splits(o[1:2, 1:], lse[1:2, 1:])
  np.testing.assert_allclose(np.asarray(out[1]), np.asarray(ref[0]), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(lse_out[1]), np.asarray(ref_lse[0]), rtol=1e-6)


def dense_problem(heads):
  """Rows of 300, 200 and 130 tokens; a NaN latent channel in row 0's token 5
  (its first split's), a NaN in head `NAN_HEAD`'s query of row 1, and NaN in
  every slot no row holds (tails, the null block, unused blocks)."""
  seq_lens = [300, 200, 130]
  q, cache, table, lens = dense.problem(31, seq_lens, heads)
  cache[table[0, 0], 5, 7] = np.nan
  q = q.at[1, NAN_HEAD, 100].set(jnp.nan)
  poisoned, _ = dense.poison(cache, table, lens)
  return q, cache, poisoned, table, lens


@pytest.mark.parametrize(
    "heads, splits, mode",
    [
        (64, 1, "select"),  # rows finished in the kernel
        (64, 3, "select"),  # the per-split ring merge, float16 partials
        (16, 3, "multiply"),  # the stacked merge of few heads
    ],
)
def test_dense_decode_gives_nan_where_valid_data_is_nan(heads, splits, mode):
  q, cache, poisoned, table, lens = dense_problem(heads)
  # "multiply" reads the unwritten tails: it runs on the clean cache.
  kv = poisoned if mode == "select" else cache
  want = dense.run_reference(q, kv, table, lens, mask_mode=mode)
  got = dense.run_decode(q, kv, table, lens, splits=splits, mask_mode=mode)
  check_nan_heads(got, want, nan_mask(3, heads, slot_row=0, q_row=1))


def sparse_problem(heads, topk=256):
  """Four rows selecting from disjoint ranges of a 1024-slot cache (20% -1),
  so that a NaN slot reaches one row alone: row 2's first tile selects one;
  row 1's head `NAN_HEAD` has a NaN query. Every slot no row selects holds
  NaN, slot 0 included."""
  rng = np.random.default_rng(37)
  batch, blocks, bs = 4, 64, 16
  span = blocks * bs // batch
  idx = np.stack([rng.integers(max(1, b * span), (b + 1) * span, topk) for b in range(batch)])
  idx = np.where(rng.random(idx.shape) < 0.2, -1, idx).astype(np.int32)
  idx[2, 3] = 2 * span + 1  # row 2's NaN slot, in its first tile
  q = jnp.asarray(rng.standard_normal((batch, heads, 576)), jnp.bfloat16)
  q = q.at[1, NAN_HEAD, 100].set(jnp.nan)
  rows = rng.standard_normal((blocks * bs, 576)).astype(np.float32)
  used = np.zeros(blocks * bs, bool)
  used[idx[idx >= 0]] = True
  rows[~used] = np.nan
  rows[2 * span + 1, 7] = np.nan
  return q, jnp.asarray(rows.reshape(blocks, bs, 576), jnp.bfloat16), jnp.asarray(idx)


@pytest.mark.parametrize(
    "name, config",
    [
        ("whole rows", SparseMLADecodeConfig(cut_rows=0, parts=0)),
        # The stream's runs cut rows 1 and 2, whose pieces the merge kernel
        # joins: row 2's first piece alone is NaN.
        ("stream, float16 partials", SparseMLADecodeConfig(parts=3, f16_partials=True)),
        # (The merge kernel's case is the stream's: splits take the same
        # `weighted_merge`, as clusters do.)
        ("two splits in clusters", SparseMLADecodeConfig(num_splits=2, cluster_merge=True)),
        ("rows in halves, XLA merge",
         SparseMLADecodeConfig(cut_rows=4, pieces=2, cluster_merge=False, combine="xla")),
    ],
)
def test_sparse_decode_gives_nan_where_valid_data_is_nan(name, config):
  q, cache, idx = sparse_problem(64)
  want = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE)
  got = sparse_mla_decode(q, cache, idx, sm_scale=SCALE, config=config, interpret=FAST)
  check_nan_heads(got, want, nan_mask(4, 64, slot_row=2, q_row=1))
