"""Pool invariants, once as a NumPy checker for tests and once as checkify checks."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from ._pool_spec import PoolSpec
from ._pool_state import PoolState


def _count(xp: Any, idx: Any, valid: Any, n: int) -> Any:
  idx = idx.reshape(-1)
  valid = valid.reshape(-1)
  if xp is np:
    return np.bincount(idx[valid], minlength=n)[:n]
  return jnp.zeros((n,), jnp.int32).at[jnp.where(valid, idx, n)].add(1, mode="drop")


def _padded_list(xp: Any, lst: Any, count: Any, n: int) -> tuple[Any, Any, Any]:
  """(live mask, ids in range and padding -1 beyond count, counts per block)."""
  live = xp.arange(lst.shape[0]) < count
  good = xp.all(xp.where(live, (lst > 0) & (lst < n), lst == -1)) & (count >= 0) & (count <= lst.shape[0])
  return live, good, _count(xp, xp.where(live, lst, 0), live, n)


def invariants(spec: PoolSpec, state: PoolState, xp: Any = np) -> dict[str, Any]:
  """Every invariant of the pool as a named scalar bool (NumPy or jnp)."""
  n, bs, m = spec.num_blocks, spec.block_size, spec.max_blocks_per_seq
  s = {f: (np.asarray(v) if xp is np else v) for f, v in vars(state).items()}
  _, queue_ok, in_queue = _padded_list(xp, s["free_queue"], s["num_free"], n)
  plive, parked_ok, in_parked = _padded_list(xp, s["parked"], s["num_parked"], n)
  steps = s["parked_step"]
  nondecreasing = xp.all(xp.where(plive[1:], steps[1:] >= steps[:-1], True))
  fence_of_parked = xp.zeros((n,), xp.int32)
  if xp is np:
    fence_of_parked = np.full((n,), -1, np.int32)
    fence_of_parked[s["parked"][plive]] = steps[plive]
  else:
    fence_of_parked = jnp.full((n,), -1, jnp.int32).at[jnp.where(plive, s["parked"], n)].set(steps, mode="drop")
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
      "free queue holds distinct real blocks, -1 past its count": queue_ok & xp.all(in_queue <= 1),
      "parked list holds distinct real blocks, -1 past its count": parked_ok & xp.all(in_parked <= 1),
      "parked steps are in order, not yet processed and not in the future": nondecreasing
      & xp.all(xp.where(plive, (steps > s["processed"]) & (steps <= s["step"]), steps == -1)),
      "block_fence matches the parked list": xp.all(s["block_fence"] == fence_of_parked),
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
