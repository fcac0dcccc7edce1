"""write_kv: both backends against the reference, padding, duplicates, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.write_kv import LAYOUTS, write_kv, write_kv_reference
from jaxkv.kernels.write_kv.reference import kv_shape

from devices import H100, as_first_device, gpu

DIMS = dict(L=2, B=4, N=4, H=2, C=16)
INTERPRET = plgpu.InterpretGPUParams(detect_races=True)
BACKENDS = ("xla", "pallas")


def _shape(layout, **over):
  dims = {**DIMS, **over}
  return tuple(dims[a] for a in layout)


def _random(rng, shape, dtype):
  return jnp.asarray(rng.standard_normal(shape) + 0.5, dtype)


def _bits(x):
  return np.asarray(x).view(np.uint8)


def _slots(rng, total, tokens, pad=2):
  slots = rng.choice(total, tokens, replace=False).astype(np.int32)
  slots[rng.choice(tokens, pad, replace=False)] = -1
  return slots


def _numpy_expected(cache, kv, slots, layout):
  """The expected bytes built independently of the jnp reference."""
  out = np.array(cache)
  n = out.shape[layout.index("N")]
  kv = np.asarray(kv)
  for t, s in enumerate(slots):
    if s < 0:
      continue
    index = []
    for a in layout:
      index.append(s // n if a == "B" else s % n if a == "N" else slice(None))
    # Advanced indices separated by slices move to the front in NumPy too.
    target = out[tuple(index)]
    order = [a for a in "LHC" if a in layout]
    kept = [a for a in layout if a not in "BN"]
    out[tuple(index)] = np.transpose(kv[t], [order.index(a) for a in kept]).reshape(target.shape)
  return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_matches_numpy(layout):
  rng = np.random.default_rng(0)
  shape = _shape(layout)
  cache = _random(rng, shape, jnp.bfloat16)
  kv = _random(rng, (7, *kv_shape(shape, layout)), jnp.bfloat16)
  slots = _slots(rng, DIMS["B"] * DIMS["N"], 7)
  ref = write_kv_reference(cache, kv, jnp.asarray(slots), layout=layout)
  np.testing.assert_array_equal(_bits(ref), _bits(_numpy_expected(cache, kv, slots, layout)))


def _check(layout, dtype, seed, backends=BACKENDS, tokens=4, **kwargs):
  rng = np.random.default_rng(seed)
  shape = _shape(layout)
  cache = _random(rng, shape, dtype)
  kv = _random(rng, (tokens, *kv_shape(shape, layout)), dtype)
  slots = _slots(rng, DIMS["B"] * DIMS["N"], tokens, pad=1)
  before = np.array(cache)
  ref = write_kv_reference(cache, kv, jnp.asarray(slots), layout=layout)
  written = {int(s) for s in slots if s >= 0}
  assert written, "the draw must write something"
  for backend in backends:
    out = write_kv(
        jnp.array(cache), kv, jnp.asarray(slots), layout=layout, backend=backend,
        interpret=INTERPRET, **kwargs,
    )
    np.testing.assert_array_equal(_bits(out), _bits(ref), err_msg=backend)
    # Every slot not written keeps its bytes.
    canon_out = _slot_major(np.asarray(out), layout)
    canon_before = _slot_major(before, layout)
    kept = [s for s in range(DIMS["B"] * DIMS["N"]) if s not in written]
    np.testing.assert_array_equal(canon_out[kept].view(np.uint8), canon_before[kept].view(np.uint8))


def _slot_major(x, layout):
  """[slots, rest...] view of a NumPy cache, for per-slot comparisons."""
  order = [layout.index("B"), layout.index("N")] + [
      i for i, a in enumerate(layout) if a not in "BN"
  ]
  x = np.transpose(x, order)
  return x.reshape(x.shape[0] * x.shape[1], -1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_bf16(layout):
  _check(layout, jnp.bfloat16, seed=LAYOUTS.index(layout))


@pytest.mark.parametrize(
    "layout,backends", [("BNC", BACKENDS), ("LBHNC", ("xla",)), ("BLNHC", ("pallas",))]
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float8_e4m3fn])
def test_dtypes(layout, dtype, backends):
  _check(layout, dtype, seed=7, backends=backends)


def test_mla_576_and_token_padding():
  """The MLA row width (576 = 9 x 64) and a token count not a multiple of the tile."""
  rng = np.random.default_rng(3)
  cache = _random(rng, (2, 4, 576), jnp.bfloat16)
  kv = _random(rng, (5, 576), jnp.bfloat16)
  slots = jnp.asarray(_slots(rng, 8, 5, pad=1))
  ref = write_kv_reference(cache, kv, slots, layout="BNC")
  for backend in BACKENDS:
    out = write_kv(jnp.array(cache), kv, slots, backend=backend, interpret=INTERPRET)
    np.testing.assert_array_equal(_bits(out), _bits(ref), err_msg=backend)


def test_kernel_block_split_uses_the_same_slot_ids():
  """A logical block of 2 kernel blocks: slot b*8+o is kernel block 2b + o//4."""
  _check("BNHC", jnp.bfloat16, seed=11, backends=("xla",), block_size=2 * DIMS["N"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_traced_in_place_and_out_of_range_skipped(backend):
  """Under jit with donation: no copy, and traced slots past the end never write.

  Two layers: slot 16 (== num_slots) would land on layer 1's first slot if
  it were not skipped.
  """
  rng = np.random.default_rng(5)
  before = np.asarray(rng.standard_normal((2, 4, 4, 1, 64)) + 0.5, jnp.bfloat16)
  # Reading a device array back pins its buffer, so copy before reading it.
  cache = jnp.copy(jnp.asarray(before))
  kv = _random(rng, (4, 2, 1, 64), jnp.bfloat16)
  slots = jnp.asarray([3, 16, -1, 15], jnp.int32)
  step = jax.jit(
      functools.partial(write_kv, backend=backend, interpret=INTERPRET), donate_argnums=0
  )
  pointer = cache.unsafe_buffer_pointer()
  out = step(cache, kv, slots)
  assert out.unsafe_buffer_pointer() == pointer
  expected = before.reshape(2, 16, 64).copy()
  expected[:, 3], expected[:, 15] = np.asarray(kv)[0, :, 0], np.asarray(kv)[3, :, 0]
  np.testing.assert_array_equal(_bits(out.reshape(2, 16, 64)), expected.view(np.uint8))


def test_traced_duplicates_touch_only_their_slot():
  rng = np.random.default_rng(6)
  cache = _random(rng, (5, 4, 32), jnp.float32)
  before = np.array(cache).reshape(20, 32)
  kv = _random(rng, (3, 32), jnp.float32)
  out = jax.jit(write_kv)(cache, kv, jnp.asarray([7, 7, 2], jnp.int32))
  out = np.asarray(out).reshape(20, 32)
  np.testing.assert_array_equal(out[2], np.asarray(kv)[2])
  others = [s for s in range(20) if s not in (2, 7)]
  np.testing.assert_array_equal(out[others], before[others])


def test_eager_rejects_out_of_range_and_duplicates_cache_unchanged():
  rng = np.random.default_rng(8)
  cache = _random(rng, (5, 4, 32), jnp.bfloat16)
  before = np.array(cache)
  kv = _random(rng, (3, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"slot_mapping has slots \[20\] >= num_slots=20"):
    write_kv(cache, kv, jnp.asarray([1, 20, -1], jnp.int32))
  with pytest.raises(ValueError, match=r"slot_mapping repeats slots \[4\]"):
    write_kv(cache, kv, jnp.asarray([4, -1, 4], jnp.int32))
  np.testing.assert_array_equal(_bits(cache), before.view(np.uint8))


def test_no_tokens_returns_the_cache():
  cache = jnp.ones((2, 4, 32), jnp.bfloat16)
  out = write_kv(cache, jnp.ones((0, 32), jnp.bfloat16), jnp.zeros((0,), jnp.int32))
  assert out is cache


BAD = [
    (dict(layout="BNX"), "layout="),
    (dict(layout="LBNHC"), "cache.shape="),
    (dict(kv=jnp.ones((3, 32), jnp.float32)), "kv.dtype="),
    (dict(kv=jnp.ones((3, 16), jnp.bfloat16)), r"kv.shape=\(3, 16\) must be \[tokens, C\]"),
    (dict(kv=jnp.ones((2, 32), jnp.bfloat16)), "kv.shape="),
    (dict(slots=jnp.zeros((3,), jnp.uint32)), "slot_mapping.shape="),
    (dict(slots=jnp.zeros((3, 1), jnp.int32)), "slot_mapping.shape="),
    (dict(block_size=6), "block_size=6"),
    (dict(block_size=16), "block_size=16"),
    (dict(backend="triton"), "backend="),
    (dict(cache=jnp.ones((2, 4, 4, 2, 3, 1), jnp.bfloat16)), "cache.shape="),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_raises_and_keeps_cache(change, message):
  rng = np.random.default_rng(9)
  cache = change.pop("cache", _random(rng, (3, 4, 32), jnp.bfloat16))
  before = np.array(cache)
  kv = change.pop("kv", _random(rng, (3, 32), jnp.bfloat16))
  slots = change.pop("slots", jnp.asarray([0, 5, -1], jnp.int32))
  with pytest.raises(ValueError, match=message):
    write_kv(cache, kv, slots, **change)
  np.testing.assert_array_equal(_bits(cache), before.view(np.uint8))


def test_pallas_rejects_rows_it_cannot_tile():
  cache = jnp.ones((2, 4, 3), jnp.bfloat16)  # 6-byte rows: not a TMA box
  with pytest.raises(ValueError, match="backend='pallas' needs a row"):
    write_kv(cache, jnp.ones((1, 3), jnp.bfloat16), jnp.asarray([1], jnp.int32), backend="pallas")
  out = write_kv(cache, jnp.full((1, 3), 2, jnp.bfloat16), jnp.asarray([1], jnp.int32))
  assert np.asarray(out)[0, 1].tolist() == [2, 2, 2]


@pytest.mark.parametrize("layout", ["BNC", "LBHNC"])
def test_compiled_kernel_lowers_for_hopper_under_its_profile_name(monkeypatch, layout):
  """The compiled launch (what a GPU runs; the other tests interpret it) lowers
  for CUDA on the CPU, as one Mosaic GPU kernel named `jaxkv_write_kv` for
  profiles, with the cache aliased (updated in place, not copied)."""
  as_first_device(monkeypatch, gpu(*H100))  # interpret=None compiles, as on a Hopper GPU
  cache = jnp.zeros(_shape(layout), jnp.bfloat16)
  kv = jnp.zeros((5, *kv_shape(cache.shape, layout)), jnp.bfloat16)
  slots = jnp.asarray([0, 3, -1, 9, 14], jnp.int32)
  call = functools.partial(write_kv, layout=layout, backend="pallas")
  text = jax.jit(call).trace(cache, kv, slots).lower(lowering_platforms=("cuda",)).as_text()
  assert "jaxkv_write_kv" in text
  # The TMA load of the tokens' rows and the bulk stores of them to their slots.
  assert "cp.async.bulk.tensor.shared.cluster.global" in text
  assert "cp.async.bulk.global.shared" in text
  assert "output_operand_alias<output_tuple_indices = [], operand_index = 2" in text
