"""zero_blocks: byte-exact against the reference (itself checked against NumPy),
in every layout, kernel-block split and dtype; padding, duplicates, jit, DCP
tails, a hybrid byte pool and bad inputs.

The full matrix (layout x split none/2/4 x tail ending in the first/a later
kernel block x float32/bfloat16/float8_e4m3fn/uint8) runs through the
reference, which is checked against a NumPy construction. The interpreted
kernel, slow on the CPU, runs a covering subset: every (layout, split) pair
once, each launch zeroing new blocks and tails together (ending in the first
and, for splits 2 and 4, in the last kernel block), the dtype cycling with
layout and split so that every dtype is launched in several layouts. Rows of
8 bytes (float8/uint8, C = 8, in BNC/LBHNC-like layouts) take the
register-store path, wider rows the TMA path. Launches of one test share one
jit, since compiling dominates interpret-mode time.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv._dcp import local_valid_slots
from jaxkv.kernels.zero_blocks import (
    ZeroBlocksConfig,
    zero_blocks,
    zero_blocks_reference,
)
from jaxkv.kernels.zero_blocks.reference import expected_bytes_numpy

from devices import H100, as_first_device, gpu

RACES = plgpu.InterpretGPUParams(detect_races=True)
# Duplicate ids write the same bytes from two CTAs on purpose (harmless zeros),
# which the race detector would report.
NO_RACES = plgpu.InterpretGPUParams()

# Few CTAs keep the interpreter (one thread per CTA) fast; each CTA still walks
# several items. Some tests below use the default (tuned) config.
SMALL_GRID = ZeroBlocksConfig(num_ctas=3, tile_bytes=128, prefetch=1)
K = 4  # kernel block size (N extent) of the matrix caches
NUM_BLOCKS = 4  # logical blocks
EXTENTS = {"L": 2, "H": 2, "C": 8}
LAYOUTS = ["LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "BNC", "BNHC"]
SPLITS = [1, 2, 4]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.uint8]


def random_bytes(shape, dtype, seed):
  """An array of `shape` whose every byte is random and non-zero."""
  itemsize = jnp.dtype(dtype).itemsize
  raw = np.random.default_rng(seed).integers(
      1, 256, size=(*shape, itemsize), dtype=np.uint8)
  return jnp.asarray(raw.view(jnp.dtype(dtype)).reshape(shape))


def as_bytes(x):
  return np.asarray(x).reshape(-1).view(np.uint8)


def matrix_shape(layout, split):
  ext = dict(EXTENTS, B=NUM_BLOCKS * split, N=K)
  return tuple(ext[a] for a in layout)


def matrix_request(split, tail_later):
  """New blocks and two tails: one ends in the first kernel block, the other
  in the first (`tail_later=False`) or the last kernel block."""
  bs = K * split
  later = bs - 1 if tail_later else 2
  ids = np.array([2, -1], np.int32)
  tails = (np.array([0, 3, -1], np.int32), np.array([1, later, 0], np.int32))
  return bs, ids, tails


_reference = jax.jit(zero_blocks_reference, static_argnames=("layout", "block_size"))


def check_exact(cache, out, ids, layout, bs, tails, check_reference=True):
  """out (== reference) == NumPy construction; zeroed bytes 0, the rest intact."""
  want = expected_bytes_numpy(np.asarray(cache), ids, layout, bs, tails)
  before, want_b = as_bytes(cache), as_bytes(want)
  if check_reference:
    ref = _reference(cache, jnp.asarray(ids), layout=layout, block_size=bs,
                     tails=tuple(map(jnp.asarray, tails)))
    np.testing.assert_array_equal(as_bytes(ref), want_b)
  zeroed = want_b == 0  # every input byte is non-zero
  assert zeroed.any() and (~zeroed).any()
  got = as_bytes(out)
  assert not got[zeroed].any(), "a byte that must be zero is not"
  np.testing.assert_array_equal(got[~zeroed], before[~zeroed])


def run_batch(fn, cases):
  """`fn(cache, ids, layout, bs, tails)` over many cases inside one jit (one
  compile for all of them: compiling dominates interpret-mode time)."""
  def all_cases(caches):
    return [fn(c, jnp.asarray(ids), layout, bs, tuple(map(jnp.asarray, tails)))
            for c, (layout, bs, ids, tails) in zip(caches, cases)]
  return jax.jit(all_cases)


def reference_fn(c, ids, layout, bs, tails):
  return zero_blocks_reference(c, ids, layout=layout, block_size=bs, tails=tails)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_full_matrix(layout):
  caches, cases = [], []
  for i, (split, later, dtype) in enumerate(
      itertools.product(SPLITS, [False, True], DTYPES)):
    caches.append(random_bytes(matrix_shape(layout, split), dtype, seed=i))
    cases.append((layout, *matrix_request(split, later)))
  outs = run_batch(reference_fn, cases)(caches)
  for cache, out, (layout, bs, ids, tails) in zip(caches, outs, cases):
    check_exact(cache, out, ids, layout, bs, tails, check_reference=False)


@pytest.mark.parametrize("li, layout", list(enumerate(LAYOUTS)))
def test_kernel_matrix(li, layout):
  """Splits none/2/4 of one layout; the dtype cycles with layout and split."""
  caches, cases = [], []
  for si, split in enumerate(SPLITS):
    dtype = DTYPES[(li + si) % len(DTYPES)]
    caches.append(random_bytes(matrix_shape(layout, split), dtype, seed=100 + 3 * li + si))
    cases.append((layout, *matrix_request(split, tail_later=split > 1)))

  def kernel_fn(c, ids, layout, bs, tails):
    out = zero_blocks(c, ids, layout=layout, block_size=bs, tails=tails,
                      interpret=RACES, config=SMALL_GRID)
    return out, reference_fn(c, ids, layout, bs, tails)

  outs = run_batch(kernel_fn, cases)(caches)
  for cache, (out, ref), (layout, bs, ids, tails) in zip(caches, outs, cases):
    np.testing.assert_array_equal(as_bytes(out), as_bytes(ref))
    check_exact(cache, out, ids, layout, bs, tails, check_reference=False)


ODD_LAYOUTS = [
    ("BNC", (6, 4, 576), jnp.bfloat16, 8),  # MLA rows: 3 TMA rows per slot
    ("BHCN", (8, 2, 3, 4), jnp.bfloat16, 8),  # slot axis innermost
    # fp8, slot innermost; three logical blocks, so that block 1 (zeroed whole
    # below) is not also a tail: overlapping requests write the same zeros from
    # two CTAs, which the race detector reports (see NO_RACES).
    ("LBHCN", (2, 6, 2, 4, 8), jnp.float8_e4m3fn, 16),
    ("NBC", (4, 8, 8), jnp.float32, 8),  # slots outside blocks
]


def test_kernel_odd_layouts():
  """Wide MLA rows, slot axis innermost (register path), N before B; the
  default tuned config."""
  caches, cases = [], []
  for i, (layout, shape, dtype, bs) in enumerate(ODD_LAYOUTS):
    caches.append(random_bytes(shape, dtype, seed=7 + i))
    nlb = shape[layout.index("B")] * shape[layout.index("N")] // bs
    tails = (np.array([0, nlb - 1], np.int32), np.array([1, bs - 3], np.int32))
    cases.append((layout, bs, np.array([1], np.int32), tails))

  def kernel_fn(c, ids, layout, bs, tails):
    out = zero_blocks(c, ids, layout=layout, block_size=bs, tails=tails,
                      interpret=RACES)
    return out, reference_fn(c, ids, layout, bs, tails)

  outs = run_batch(kernel_fn, cases)(caches)
  for cache, (out, ref), (layout, bs, ids, tails) in zip(caches, outs, cases):
    np.testing.assert_array_equal(as_bytes(out), as_bytes(ref))
    check_exact(cache, out, ids, layout, bs, tails, check_reference=False)


def test_duplicates_and_padding():
  cache = random_bytes((12, 4, 16), jnp.bfloat16, seed=3)
  ids = np.array([1, -1, 1, 4, -1], np.int32)
  tails = (np.array([4, 2, -1, 2], np.int32), np.array([3, 5, 2, 1], np.int32))
  out = zero_blocks(cache, jnp.asarray(ids), layout="BNC", block_size=8,
                    tails=tuple(map(jnp.asarray, tails)), interpret=NO_RACES)
  check_exact(cache, out, ids, "BNC", 8, tails)


def test_empty_request_launches_nothing():
  cache = random_bytes((4, 4, 16), jnp.float32, seed=4)
  empty = jnp.zeros((0,), jnp.int32)
  assert zero_blocks(cache, empty, layout="BNC") is cache
  assert zero_blocks(cache, empty, layout="BNC", tails=(empty, empty)) is cache


def test_jit_traced_ids_out_of_range_are_padding():
  layout, bs = "BNHC", 8  # 4 logical blocks of 2 kernel blocks

  def step(c, ids, tail_ids, valid):
    return zero_blocks(c, ids, layout=layout, block_size=bs,
                       tails=(tail_ids, valid), interpret=RACES)

  step = jax.jit(step, donate_argnums=0)
  cache = random_bytes((8, 4, 2, 16), jnp.bfloat16, seed=5)
  ids = jnp.array([1, 9, -7], jnp.int32)  # 9 and -7: out of range, ignored
  tail_ids = jnp.array([3, 2, 4], jnp.int32)
  valid = jnp.array([-2, 99, 0], jnp.int32)  # clipped to 0 and 8
  out = step(jnp.copy(cache), ids, tail_ids, valid)
  want_ids = np.array([1], np.int32)
  want_tails = (np.array([3], np.int32), np.array([0], np.int32))
  check_exact(cache, out, want_ids, layout, bs, want_tails)


def test_dcp_tail_all_ranks():
  """DCP 8, interleave 1, 275,089 tokens, logical blocks of 12,288 tokens =
  1,536 rank-local slots = 24 kernel blocks of 64. Rank r's last block is
  logical block r of one cache holding all eight ranks' blocks."""
  dcp, tokens, block_tokens, k = 8, 275_089, 12_288, 64
  local_bs = block_tokens // dcp
  last_start = tokens // block_tokens * block_tokens
  assert tokens - last_start == 4_753
  valid = np.array([local_valid_slots(tokens - last_start, dcp, r, 1)
                    for r in range(dcp)], np.int32)
  np.testing.assert_array_equal(valid, [595] + [594] * 7)
  seq_level = [local_valid_slots(tokens, dcp, r, 1) % local_bs for r in range(dcp)]
  np.testing.assert_array_equal(valid, seq_level)
  cache = random_bytes((dcp * local_bs // k, k, 16), jnp.bfloat16, seed=8)
  ranks = np.arange(dcp, dtype=np.int32)
  out = zero_blocks(cache, jnp.zeros((0,), jnp.int32), layout="BNC",
                    block_size=local_bs, tails=(jnp.asarray(ranks), jnp.asarray(valid)),
                    interpret=RACES)
  got = as_bytes(out).reshape(dcp, local_bs, -1)
  before = as_bytes(cache).reshape(dcp, local_bs, -1)
  for r in range(dcp):
    # Global token of rank r's local slot s: last_start + s * dcp + r.
    invalid = last_start + np.arange(local_bs) * dcp + r >= tokens
    assert invalid.sum() == local_bs - valid[r]
    assert not got[r][invalid].any()
    np.testing.assert_array_equal(got[r][~invalid], before[r][~invalid])
  # Fully valid kernel blocks (0..8 on every rank) are untouched.
  np.testing.assert_array_equal(got[:, :9 * k], before[:, :9 * k])


def test_hybrid_pool_two_views():
  """One raw byte pool, viewed by a float32 group and a bfloat16 group."""
  nb, block_bytes = 6, 256
  pool = jnp.asarray(as_bytes(random_bytes((nb, block_bytes), jnp.uint8, seed=9))
                     .reshape(nb, block_bytes))

  def view(p, dtype, shape):
    words = p.reshape(nb, -1, jnp.dtype(dtype).itemsize)
    return jax.lax.bitcast_convert_type(words, dtype).reshape(shape)

  def unview(v):
    return jax.lax.bitcast_convert_type(v, jnp.uint8).reshape(nb, block_bytes)

  a = view(pool, jnp.float32, (nb, 4, 2, 8))  # BNHC, 64 bytes per slot
  b = view(pool, jnp.bfloat16, (nb, 8, 16))  # BNC, 32 bytes per slot
  via_a = unview(zero_blocks(a, jnp.array([3], jnp.int32), layout="BNHC",
                             interpret=RACES))
  via_b = unview(zero_blocks(b, jnp.zeros((0,), jnp.int32), layout="BNC",
                             tails=(jnp.array([5], jnp.int32), jnp.array([3], jnp.int32)),
                             interpret=RACES))
  want_a = np.asarray(pool).copy()
  want_a[3] = 0
  want_b = np.asarray(pool).copy()
  want_b[5, 3 * 32:] = 0
  np.testing.assert_array_equal(np.asarray(via_a), want_a)
  np.testing.assert_array_equal(np.asarray(via_b), want_b)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_ids=np.array([4], np.int32)), "block_ids"),
        (dict(block_ids=np.array([-2], np.int32)), "block_ids"),
        (dict(block_ids=np.array([1.0], np.float32)), "block_ids"),
        (dict(block_ids=np.array([[1]], np.int32)), "block_ids"),
        (dict(tails=(np.array([1], np.int32), np.array([9], np.int32))), "valid_slots"),
        (dict(tails=(np.array([1], np.int32), np.array([-1], np.int32))), "valid_slots"),
        (dict(tails=(np.array([5], np.int32), np.array([1], np.int32))), "tail ids"),
        (dict(tails=(np.array([1, 2], np.int32), np.array([1], np.int32))), "valid_slots"),
        (dict(tails=np.array([1], np.int32)), "tails"),
        (dict(layout="BNX"), "layout"),
        (dict(layout="BBC"), "layout"),
        (dict(layout="LBNHC"), "layout"),
        (dict(layout="BN"), "layout"),
        (dict(block_size=6), "block_size"),
        (dict(block_size=12), "block_size"),
    ],
)
def test_bad_input_raises_and_keeps_cache(kwargs, match):
  cache = random_bytes((8, 4, 16), jnp.bfloat16, seed=10)  # BNC, 4 blocks of 8
  before = as_bytes(cache).copy()
  args = dict(block_ids=np.array([1], np.int32), layout="BNC", block_size=8)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    zero_blocks(cache, args.pop("block_ids"), interpret=RACES, **args)
  np.testing.assert_array_equal(as_bytes(cache), before)


@pytest.mark.parametrize(
    "kwargs", [dict(tile_bytes=8), dict(item_rows=48), dict(num_ctas=0), dict(prefetch=0)])
def test_config_validation(kwargs):
  with pytest.raises(ValueError):
    ZeroBlocksConfig(**kwargs)


@pytest.mark.parametrize("dtype, tma", [(jnp.bfloat16, True), (jnp.uint8, False)])
def test_compiled_kernel_lowers_for_hopper_under_its_profile_name(monkeypatch, dtype, tma):
  """The compiled launch (what a GPU runs; the other tests interpret it) lowers
  for CUDA on the CPU as one Mosaic GPU kernel named `jaxkv_zero_blocks`, the
  cache aliased (zeroed in place): by TMA stores from a zeroed SMEM tile where
  a slot row is a multiple of 16 bytes, by stores from registers otherwise."""
  as_first_device(monkeypatch, gpu(*H100))  # interpret=None compiles, as on a Hopper GPU
  cache = jnp.zeros((2, 8, 4, 2, 16 if tma else 3), dtype)  # LBNHC: 64- or 6-byte rows

  def call(cache, ids, tail_ids, valid):
    return zero_blocks(cache, ids, layout="LBNHC", tails=(tail_ids, valid),
                       config=ZeroBlocksConfig(implementation="pallas"))

  args = (cache, *(jnp.asarray(x, jnp.int32) for x in ([3, -1], [1, -1], [2, 0])))
  text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "jaxkv_zero_blocks" in text
  assert ("cp.async.bulk.global.shared" in text) == tma
  assert "output_operand_alias<output_tuple_indices = [], operand_index = 1" in text
