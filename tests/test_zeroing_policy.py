"""The backend registry and the per-group zeroing decision, path by path."""

import itertools

import pytest

import jaxkv
from jaxkv import (
    AttentionBackend,
    CompositeBackend,
    FullAttentionSpec,
    HybridPoolSpec,
    KVCacheGroup,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    get_backend,
    group_requires_zeroing,
    merge,
    project_uniform_type,
    registered_backends,
)
from jaxkv._zeroing import CLASSIFIED_SPEC_TYPES

REQUIRED_NAMES = {
    "xla_mla_reference": ("select", False),
    "pallas_mla_decode_select": ("select", False),
    "pallas_mla_decode_multiply": ("multiply", True),
    "pallas_sparse_mla_decode_select": ("select", False),
    "pallas_sparse_mla_decode_multiply": ("multiply", True),
    "xla_full_attention_reference": ("select", False),
}


def test_registry_declares_masking_and_zeroing():
  for name, (masking, zeroing) in REQUIRED_NAMES.items():
    b = get_backend(name)
    assert (b.masking, b.requires_kv_cache_zeroing) == (masking, zeroing), name
  with pytest.raises(ValueError, match="unknown backend 'nope'"):
    get_backend("nope")
  with pytest.raises(ValueError, match="already registered"):
    jaxkv.register_backend(get_backend("xla_mla_reference"))


def test_multiply_backend_must_declare_zeroing():
  with pytest.raises(ValueError, match="requires_kv_cache_zeroing must be True"):
    AttentionBackend("bad", (MLAAttentionSpec,), (64,), "multiply", False)
  with pytest.raises(ValueError, match="masking"):
    AttentionBackend("bad", (MLAAttentionSpec,), (64,), "maybe", False)


@pytest.mark.parametrize("field, value", [
    ("name", ""), ("name", 3), ("spec_types", [MLAAttentionSpec]), ("spec_types", (int,)),
    ("spec_types", ("mla",)), ("kernel_block_sizes", ()), ("kernel_block_sizes", (64, 0)),
    ("kernel_block_sizes", (True,)), ("kernel_block_sizes", (64.0,)),
    ("kernel_block_sizes", [64]), ("requires_kv_cache_zeroing", "yes"),
    ("requires_kv_cache_zeroing", 1), ("entry", None), ("mask_mode", "maybe"),
])
def test_bad_backend_fields_name_the_field(field, value):
  """An engine's own backend is checked as it is made: a zeroing flag that is
  not a bool (a truthy "yes" would pass a "multiply" backend), or block sizes
  that are not positive ints, name the field."""
  fields = dict(name="mine", spec_types=(MLAAttentionSpec,), kernel_block_sizes=(64,),
                masking="multiply", requires_kv_cache_zeroing=True, entry="", mask_mode=None)
  AttentionBackend(**fields)
  fields[field] = value
  with pytest.raises(ValueError, match=field if field != "name" else "name="):
    AttentionBackend(**fields)


def test_bad_composite_fields_name_the_field():
  sel = get_backend("xla_mla_reference")
  with pytest.raises(ValueError, match="decode="):
    CompositeBackend("c", sel, "pallas_mla_decode_multiply")
  with pytest.raises(ValueError, match="prefill="):
    CompositeBackend("c", None, sel)
  with pytest.raises(ValueError, match="name="):
    CompositeBackend("", sel, sel)


def test_composite_requires_zeroing_if_either_child_does():
  sel, mul = get_backend("xla_mla_reference"), get_backend("pallas_mla_decode_multiply")
  for prefill, decode in itertools.product((sel, mul), repeat=2):
    c = CompositeBackend("c", prefill, decode)
    assert c.requires_kv_cache_zeroing == (prefill is mul or decode is mul)
    assert c.masking == ("multiply" if c.requires_kv_cache_zeroing else "select")
  with pytest.raises(ValueError, match="share no spec type"):
    CompositeBackend("c", sel, get_backend("xla_full_attention_reference"))


def _group(spec, backend, name="g", layers=("l0",)):
  return KVCacheGroup(name, layers, spec, backend)


def test_backend_path():
  mla = MLAAttentionSpec(64)
  assert not group_requires_zeroing(_group(mla, "pallas_mla_decode_select"))
  d = group_requires_zeroing(_group(mla, "pallas_mla_decode_multiply"))
  assert d.required and "pallas_mla_decode_multiply" in d.reasons[0]


def test_composite_path():
  mla = MLAAttentionSpec(64)
  d = group_requires_zeroing(_group(mla, "mla_reference_prefill_pallas_decode_multiply"))
  assert d.required and "pallas_mla_decode_multiply" in d.reasons[0]
  assert not group_requires_zeroing(_group(mla, "mla_reference_prefill_pallas_decode_select"))


def test_decision_survives_merge_and_uniform_projection():
  layers = [FullAttentionSpec(16, 8, 128)] * 3
  merged = merge(layers)
  a = group_requires_zeroing(_group(merged, "xla_full_attention_reference", layers=("a", "b", "c")))
  b = group_requires_zeroing(_group(layers[0], "xla_full_attention_reference"))
  assert a == b and not a.required
  uniform = project_uniform_type({"a": FullAttentionSpec(16, 8, 128), "b": FullAttentionSpec(16, 2, 64)})
  assert not group_requires_zeroing(_group(uniform, "xla_full_attention_reference", layers=("a", "b")))
  # A uniform projection of recurrent layers still holds recurrent state.
  ssm = project_uniform_type({"a": MambaSpec(16, ((4,),), ("float32",)), "b": MambaSpec(16, ((8,),), ("float32",))})
  d = group_requires_zeroing(_group(ssm, "xla_linear_attention_reference", layers=("a", "b")))
  assert d.required and d.reasons == ("the pool holds recurrent state",)
  # And a multiply backend through a projection still requires zeroing.
  mla_u = project_uniform_type({"a": MLAAttentionSpec(64), "b": MLAAttentionSpec(64, dtype="float8_e4m3fn")})
  assert group_requires_zeroing(_group(mla_u, "pallas_mla_decode_multiply", layers=("a", "b"))).required


def test_pool_composition_paths():
  mla = _group(MLAAttentionSpec(64), "pallas_mla_decode_select", "mla", ("l0",))
  mla_fp8 = _group(MLAAttentionSpec(64, dtype="float8_e4m3fn"), "pallas_mla_decode_select", "mla8", ("l1",))
  ssm = _group(MambaSpec(64, ((4, 4),), ("bfloat16",)), "xla_linear_attention_reference", "ssm", ("l2",))
  mixed = HybridPoolSpec(8, (mla, mla_fp8))
  d = group_requires_zeroing(mla, mixed)
  assert d.required and d.reasons == ("the pool overlays groups of different dtypes",)
  # Same dtype, but one group holds recurrent state: every group zeroes.
  recurrent = HybridPoolSpec(8, (mla, ssm))
  for g in (mla, ssm):
    d = group_requires_zeroing(g, recurrent)
    assert d.reasons == ("the pool holds recurrent state",)
  same = HybridPoolSpec(8, (mla, _group(MLAAttentionSpec(64), "pallas_mla_decode_select", "other", ("l3",))))
  assert not group_requires_zeroing(mla, same).required
  with pytest.raises(ValueError, match="not one of the pool's groups"):
    group_requires_zeroing(ssm, same)


def test_mismatched_backend_and_unknown_spec_type_are_errors():
  with pytest.raises(ValueError, match="does not serve FullAttentionSpec"):
    group_requires_zeroing(_group(FullAttentionSpec(16), "pallas_mla_decode_select"))
  with pytest.raises(ValueError, match="does not serve SlidingWindowSpec"):
    group_requires_zeroing(_group(SlidingWindowSpec(16), "pallas_mla_decode_select"))

  class OtherSpec(MLAAttentionSpec):
    pass

  with pytest.raises(ValueError, match="not classified"):
    group_requires_zeroing(_group(OtherSpec(64), "pallas_mla_decode_select"))


def _example_spec(spec_type):
  return {
      FullAttentionSpec: FullAttentionSpec(16, 2, 64),
      SlidingWindowSpec: SlidingWindowSpec(16, 2, 64, sliding_window=32),
      MLAAttentionSpec: MLAAttentionSpec(16),
      MambaSpec: MambaSpec(16, ((4,),), ("float32",)),
  }[spec_type]


def test_no_registered_combination_falls_through():
  """Every registered backend x served spec type x pool composition gets a reasoned decision."""
  seen = 0
  for backend in registered_backends():
    for spec_type in backend.spec_types:
      assert spec_type in CLASSIFIED_SPEC_TYPES, (backend.name, spec_type)
      group = _group(_example_spec(spec_type), backend.name)
      other = _group(MLAAttentionSpec(16, dtype="float32"), "xla_mla_reference", "other", ("o",))
      for pool in (None, HybridPoolSpec(4, (group,)), HybridPoolSpec(4, (group, other))):
        d = group_requires_zeroing(group, pool)
        assert isinstance(d.required, bool) and d.reasons
        expected = (
            backend.requires_kv_cache_zeroing
            or spec_type is MambaSpec
            or (pool is not None and pool.mixes_dtypes)
        )
        assert d.required == expected, (backend.name, spec_type, pool)
        seen += 1
  assert seen >= 3 * len(REQUIRED_NAMES)
