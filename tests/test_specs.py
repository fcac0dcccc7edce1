"""Specs: validation, page sizes, merge, uniform-type projection and the hybrid pool."""

import jax.numpy as jnp
import pytest

import jaxkv
from jaxkv import (
    FullAttentionSpec,
    HybridPoolSpec,
    KVCacheGroup,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    merge,
    project_uniform_type,
)


def test_page_sizes():
  assert FullAttentionSpec(16, num_kv_heads=8, head_size=128, dtype=jnp.bfloat16).page_size_bytes == 16 * 8 * 256 * 2
  assert FullAttentionSpec(16, 8, 128, "float32", head_size_v=64).page_size_bytes == 16 * 8 * 192 * 4
  assert SlidingWindowSpec(32, 4, 64, "bfloat16", sliding_window=1024).page_size_bytes == 32 * 4 * 128 * 2
  assert MLAAttentionSpec(64).page_size_bytes == 64 * 576 * 2
  assert MLAAttentionSpec(64, dtype="float8_e4m3fn").page_size_bytes == 64 * 576
  assert MambaSpec(1, shapes=((4, 8), (3,)), dtypes=("float32", "bfloat16")).page_size_bytes == 4 * 8 * 4 + 3 * 2


def test_specs_are_hashable_and_normalise_dtypes():
  a = MLAAttentionSpec(64, dtype=jnp.bfloat16)
  b = MLAAttentionSpec(64, dtype="bfloat16")
  assert a == b and hash(a) == hash(b) and a.dtype == "bfloat16"
  m = MambaSpec(1, shapes=[[4, 8]], dtypes=[jnp.float32])
  assert m.shapes == ((4, 8),) and m.dtypes == ("float32",)
  assert len({a, b, m}) == 2
  with pytest.raises(Exception):
    a.block_size = 3  # frozen


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: MLAAttentionSpec(0), "block_size"),
        (lambda: MLAAttentionSpec(64, kv_lora_rank=-1), "kv_lora_rank"),
        (lambda: MLAAttentionSpec(64, dtype="not_a_dtype"), "dtype"),
        (lambda: FullAttentionSpec(16, num_kv_heads=0), "num_kv_heads"),
        (lambda: FullAttentionSpec(16, head_size=True), "head_size"),
        (lambda: SlidingWindowSpec(16, sliding_window=0), "sliding_window"),
        (lambda: MambaSpec(1, shapes=(), dtypes=()), "shapes"),
        (lambda: MambaSpec(1, shapes=((4,),), dtypes=("float32", "float32")), "dtypes"),
        (lambda: MambaSpec(1, shapes=((4, 0),), dtypes=("float32",)), r"shapes\[0\]"),
    ],
)
def test_bad_specs_name_the_field(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_merge_equal_specs_and_name_the_differing_field():
  s = FullAttentionSpec(16, 8, 128, "bfloat16")
  assert merge([s, FullAttentionSpec(16, 8, 128, "bfloat16")]) == s
  with pytest.raises(ValueError, match=r"'num_kv_heads' differs: specs\[0\].num_kv_heads=8, specs\[2\].num_kv_heads=4"):
    merge([s, s, FullAttentionSpec(16, 4, 128, "bfloat16")])
  with pytest.raises(ValueError, match="'dtype' differs"):
    merge([s, FullAttentionSpec(16, 8, 128, "float16")])
  with pytest.raises(ValueError, match="different types"):
    merge([s, SlidingWindowSpec(16, 8, 128, "bfloat16", sliding_window=64)])
  with pytest.raises(ValueError, match="'sliding_window' differs"):
    merge([SlidingWindowSpec(16, sliding_window=64), SlidingWindowSpec(16, sliding_window=128)])
  with pytest.raises(ValueError, match="'shapes' differs"):
    merge([MambaSpec(1, ((4,),), ("float32",)), MambaSpec(1, ((5,),), ("float32",))])
  with pytest.raises(ValueError, match="at least one"):
    merge([])


def test_uniform_type_projection_sums_pages():
  layers = {"l0": FullAttentionSpec(16, 8, 128), "l1": FullAttentionSpec(16, 2, 64)}
  u = project_uniform_type(layers)
  assert u is not None and u.layer_type is FullAttentionSpec
  assert u.page_size_bytes == layers["l0"].page_size_bytes + layers["l1"].page_size_bytes
  assert jaxkv.spec_dtypes(u) == ("bfloat16",)
  # Different types or block sizes do not project.
  assert project_uniform_type({"a": FullAttentionSpec(16), "b": MLAAttentionSpec(16)}) is None
  assert project_uniform_type({"a": FullAttentionSpec(16), "b": FullAttentionSpec(32)}) is None
  assert project_uniform_type({}) is None


def _mla_group(name="mla", layers=("l0",), backend="pallas_mla_decode_select", **kw):
  return KVCacheGroup(name, layers, MLAAttentionSpec(64, **kw), backend)


def test_hybrid_pool_unifies_page_to_largest_and_records_padding():
  mamba = KVCacheGroup("ssm", ("l1", "l2"), MambaSpec(64, ((16, 64, 64),), ("float32",)), "xla_linear_attention_reference")
  pool = HybridPoolSpec(num_blocks=10, groups=(_mla_group(), mamba))
  assert pool.page_size_bytes == 16 * 64 * 64 * 4
  assert pool.padding_bytes == {"mla": 16 * 64 * 64 * 4 - 64 * 576 * 2, "ssm": 0}
  assert pool.num_tensors == 2 and pool.total_bytes == 2 * 10 * pool.page_size_bytes
  assert pool.mixes_dtypes and pool.holds_recurrent_state and pool.is_overlaid
  single = HybridPoolSpec(num_blocks=10, groups=(_mla_group(),))
  assert not single.mixes_dtypes and not single.holds_recurrent_state and not single.is_overlaid


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_blocks=1, groups=(_mla_group(),)), "num_blocks"),
        (dict(num_blocks=8, groups=()), "groups"),
        (dict(num_blocks=8, groups=(_mla_group(), _mla_group())), "unique"),
        (dict(num_blocks=8, groups=(_mla_group(), _mla_group("b"))), "more than one group"),
        (dict(num_blocks=8, groups=(_mla_group(), KVCacheGroup("f", ("x",), FullAttentionSpec(16), "xla_full_attention_reference"))), "block_size"),
    ],
)
def test_bad_pools(kwargs, match):
  with pytest.raises(ValueError, match=match):
    HybridPoolSpec(**kwargs)
