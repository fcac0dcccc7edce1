"""Pool invariants, once as a NumPy checker for tests and once as checkify checks."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from ._pool_spec import PoolSpec
from ._pool_state import SEQ_MASK, PoolState


def _count(xp: Any, idx: Any, valid: Any, n: int) -> Any:
  idx = idx.reshape(-1)
  valid = valid.reshape(-1)
  if xp is np:
    return np.bincount(idx[valid], minlength=n)[:n]
  return jnp.zeros((n,), jnp.int32).at[jnp.where(valid, idx, n)].add(1, mode="drop")


def _padded_list(xp: Any, lst: Any, count: Any, n: int, head: Any = 0,
                 stale_ok: bool = False) -> tuple[Any, Any, Any]:
  """(live mask, ids in range and -1 outside the live entries, counts per block).

  The live entries are `count` from `head` on, wrapping around (a ring);
  with `stale_ok` the others may hold anything.
  """
  size = lst.shape[0]
  live = (xp.arange(size) - head + size) % size < count
  good = xp.all(xp.where(live, (lst > 0) & (lst < n), stale_ok | (lst == -1))) & (count >= 0) & (count <= size)
  return live, good, _count(xp, xp.where(live, lst, 0), live, n)


def invariants(spec: PoolSpec, state: PoolState, xp: Any = np) -> dict[str, Any]:
  """Every invariant of the pool as a named scalar bool (NumPy or jnp)."""
  n, bs, m = spec.num_blocks, spec.block_size, spec.max_blocks_per_seq
  if xp is np:  # one transfer, then every packed field is a NumPy slice
    state = jax.device_get(state)
  s = state.fields()
  heads = [s[k] for k in ("queue_head", "parked_u_head", "parked_h_head")]
  head_ok = xp.all(xp.stack([(h >= 0) & (h < n) for h in heads]))
  _, queue_ok, in_queue = _padded_list(xp, s["free_queue"], s["num_free"], n, s["queue_head"])
  # Two parked rings (unhashed, hashed), each in free order: steps never
  # decrease from the head, every entry's hash flag matches its ring, and
  # the park order numbers increase (modulo 2**30) from the oldest.
  in_parked = fence_of_parked = None
  rings_ok = True
  oldest = s["park_seq"] - s["num_parked_u"] - s["num_parked_h"]
  for ring, is_hashed in (("u", False), ("h", True)):
    blk, steps, seq = s[f"parked_{ring}"], s[f"parked_{ring}_step"], s[f"parked_{ring}_seq"]
    head = s[f"parked_{ring}_head"]
    live, ok, counts = _padded_list(xp, blk, s[f"num_parked_{ring}"], n, head, stale_ok=True)
    order = (xp.arange(n) + head) % n
    olive = live[order]
    key = (seq[order] - oldest) & SEQ_MASK
    in_order = xp.where(olive[1:], (steps[order][1:] >= steps[order][:-1]) & (key[1:] > key[:-1]), True)
    flags = xp.where(live, s["hashed"][xp.where(live, blk, 0)] == is_hashed, True)
    rings_ok = rings_ok & ok & xp.all(in_order) & xp.all(flags)
    in_parked = counts if in_parked is None else in_parked + counts
    if xp is np:
      fence = np.full((n,), -1, np.int32)
      fence[blk[live]] = steps[live]
    else:
      fence = jnp.full((n,), -1, jnp.int32).at[jnp.where(live, blk, n)].set(steps, mode="drop")
    fence_of_parked = fence if fence_of_parked is None else xp.maximum(fence_of_parked, fence)
    rings_ok = rings_ok & xp.all(xp.where(live, (steps > s["processed"]) & (steps <= s["step"]), True))
  parked_ok = rings_ok
  nb = (s["num_tokens"] + bs - 1) // bs
  col = xp.arange(m)[None, :]
  inside = s["active"][:, None] & (col < nb[:, None])
  table = s["block_table"]
  holders = _count(xp, table, inside & (table > 0), n)
  ref = s["ref_count"]
  owned = ref > 0
  ids = xp.arange(n)
  places = in_queue.astype(xp.int32) + in_parked.astype(xp.int32) + owned.astype(xp.int32)
  slot = (s["block_hash"][:, 0] & np.uint32(spec.hash_table_size - 1)).astype(xp.int32)
  tbl = s["hash_table"]
  tlive = tbl >= 0
  tsafe = xp.where(tlive, tbl, 0)
  zlive, zero_ok, in_zero = _padded_list(xp, s["zero_list"], s["num_zero"], n)
  tlv, tails_ok, in_tails = _padded_list(xp, s["tail_ids"], s["num_tails"], n)
  valid_slots = s["tail_valid"]
  return {
      "free queue holds distinct real blocks, -1 past its count": head_ok & queue_ok & xp.all(in_queue <= 1),
      "parked rings hold distinct real blocks in free order, steps not yet processed": parked_ok
      & xp.all(in_parked <= 1),
      "block_fence matches the parked list (processed steps elsewhere)": xp.all(xp.where(
          fence_of_parked >= 0, s["block_fence"] == fence_of_parked, s["block_fence"] <= s["processed"])),
      "every real block is in exactly one place": xp.all(places[1:] == 1),
      "the null block is nowhere": (places[0] == 0) & (ref[0] == 0) & ~s["hashed"][0]
      & (in_zero[0] == 0) & (in_tails[0] == 0),
      "ref counts equal the number of table entries": xp.all(ref == holders) & xp.all(ref >= 0),
      "table entries inside a sequence are real blocks, padding is 0": xp.all(
          xp.where(inside, table > 0, table == 0)),
      "inactive sequences hold no tokens or loads": xp.all(
          xp.where(s["active"], True, (s["num_tokens"] == 0) & ~s["loading"])),
      "token counts fit the table": xp.all((s["num_tokens"] >= 0) & (s["num_tokens"] <= m * bs)),
      "loads lie inside their sequence": xp.all(xp.where(
          s["loading"], (s["load_start"] < s["load_end"]) & (s["load_end"] <= s["num_tokens"]), True)),
      "free count is conserved": s["num_free"] + s["num_parked"] + xp.sum(owned[1:].astype(xp.int32)) == n - 1,
      "hashed blocks are exactly the hash-table entries at their slot": xp.all(
          s["hashed"] == (tbl[slot] == ids)) & xp.all(xp.where(tlive, s["hashed"][tsafe] & (slot[tsafe] == xp.arange(tbl.shape[0])), True)),
      "zero list holds real blocks, -1 past its count": zero_ok,
      "tails hold real blocks with valid slots in [1, block_size)": tails_ok & xp.all(xp.where(
          tlv, (valid_slots >= 1) & (valid_slots < bs), valid_slots == -1)),
      "processed steps do not run ahead": (s["processed"] <= s["step"]) & (s["processed"] >= 0),
  }


def assert_pool_valid(spec: PoolSpec, state: PoolState) -> None:
  """NumPy check of every invariant; raises AssertionError naming the broken ones."""
  broken = [name for name, ok in invariants(spec, state, np).items() if not bool(ok)]
  if broken:
    raise AssertionError("pool invariants broken: " + "; ".join(broken))


def check_pool(spec: PoolSpec, state: PoolState) -> None:
  """The same invariants as `checkify.check`s (inside `checkify.checkify`)."""
  with jax.named_scope("jaxkv.check_pool"):
    for name, ok in invariants(spec, state, jnp).items():
      checkify.check(ok, f"pool invariant broken: {name}")
