"""The zeroing policy: which KV cache groups must zero newly allocated blocks (rules 3 and 6)."""

from __future__ import annotations

import dataclasses

from ._backends import AttentionBackend, CompositeBackend, get_backend
from ._groups import HybridPoolSpec, KVCacheGroup
from ._specs import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeSpec,
)

# Every spec type the policy knows how to classify; anything else is an error
# rather than a silent "no zeroing".
CLASSIFIED_SPEC_TYPES = (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec, MambaSpec)


@dataclasses.dataclass(frozen=True)
class ZeroingDecision:
  """Whether a group zeroes new blocks and tails, and every reason that applies."""

  required: bool
  reasons: tuple[str, ...]

  def __bool__(self) -> bool:
    return self.required


def _layer_type(spec: KVCacheSpec) -> type[KVCacheSpec]:
  if isinstance(spec, UniformTypeSpec):
    return spec.layer_type
  return type(spec)


def group_requires_zeroing(group: KVCacheGroup, pool: HybridPoolSpec | None = None) -> ZeroingDecision:
  """Decides whether `group` must zero every newly allocated block before its first read.

  Args:
    group: the group (its spec may be merged or a uniform-type projection; its
      backend may be composite).
    pool: the pool the group lives in; None for a pool of this group alone.

  Returns:
    The decision with its reasons: the backend declares
    `requires_kv_cache_zeroing` (a composite if either child does), or the pool
    overlays groups of different dtypes, or the pool holds recurrent state.

  Raises:
    ValueError: unknown backend, a backend that does not serve the group's spec
      type, a spec type the policy does not classify, or a group not in `pool`.
  """
  spec_type = _layer_type(group.spec)
  if spec_type not in CLASSIFIED_SPEC_TYPES:
    raise ValueError(
        f"group {group.name!r}: spec type {spec_type.__name__} is not classified by the"
        f" zeroing policy (known: {[t.__name__ for t in CLASSIFIED_SPEC_TYPES]})"
    )
  backend = get_backend(group.backend)
  if not backend.serves(spec_type):
    raise ValueError(
        f"group {group.name!r}: backend {backend.name!r} does not serve {spec_type.__name__}"
        f" (it serves {[t.__name__ for t in backend.spec_types]})"
    )
  if pool is None:
    pool = HybridPoolSpec(num_blocks=2, groups=(group,))
  elif group not in pool.groups:
    raise ValueError(f"group {group.name!r} is not one of the pool's groups")

  reasons = []
  if backend.requires_kv_cache_zeroing:
    reasons.append(f"backend {backend.name!r} {_why(backend)}")
  if pool.mixes_dtypes:
    reasons.append("the pool overlays groups of different dtypes")
  if pool.holds_recurrent_state:
    reasons.append("the pool holds recurrent state")
  if reasons:
    return ZeroingDecision(True, tuple(reasons))
  return ZeroingDecision(
      False,
      (f"backend {backend.name!r} masks by select and the pool holds only {spec_type.__name__}"
       " attention caches of one dtype",),
  )


def _why(backend: AttentionBackend | CompositeBackend) -> str:
  if isinstance(backend, CompositeBackend):
    needy = [c.name for c in backend.children if c.requires_kv_cache_zeroing]
    return f"requires_kv_cache_zeroing through {needy}"
  return f"requires_kv_cache_zeroing ({backend.masking} masking)"


def pool_zeroing_plan(pool: HybridPoolSpec) -> dict[str, ZeroingDecision]:
  """The decision for every group of a pool, by group name."""
  return {g.name: group_requires_zeroing(g, pool) for g in pool.groups}
