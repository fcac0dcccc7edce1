"""A tiny pure-Python model of the block pool: lists and dicts, one request at a time.

It states the pool's policy in the most direct way (a linked free list would
behave the same) and is what the jitted transitions are checked against.
Inputs are assumed valid; misuse is tested against the device code directly.
"""

from __future__ import annotations


def _ceil(a, b):
  return -(-a // b)


class PoolModel:

  def __init__(self, spec):
    self.spec = spec
    self.queue = list(range(1, spec.num_blocks))  # front first
    self.ref = [0] * spec.num_blocks
    self.hash = {}  # block -> digest (tuple of two ints), registered blocks only
    self.index = {}  # slot -> block
    self.parked = []  # (block, step) in free order
    self.seqs = {}  # sid -> {"blocks", "tokens", "loading", "load_start", "load_end"}
    self.zero = []
    self.tails = []  # (block, valid_slots)
    self.step = 0
    self.processed = 0

  # -- helpers ---------------------------------------------------------------
  def _slot(self, digest):
    return digest[0] & (self.spec.hash_table_size - 1)

  def _pop(self):
    b = self.queue.pop(0)
    if b in self.hash:  # eviction
      del self.index[self._slot(self.hash.pop(b))]
    return b

  def _push(self, b):
    if b in self.hash:
      self.queue.append(b)
    else:
      self.queue.insert(0, b)

  def _release(self, b):
    if self.spec.defer_block_free and self.step > self.processed:
      self.parked.append((b, self.step))
    else:
      self._push(b)

  def _parked_blocks(self):
    return {b for b, _ in self.parked}

  # -- transitions -----------------------------------------------------------
  def grow(self, reqs):
    bs, zero = self.spec.block_size, self.spec.zero_new_blocks
    free0, zroom = len(self.queue), self.spec.max_zero_list - len(self.zero)
    cum = cumz = 0
    oks = []
    for sid, n in reqs:
      if sid < 0:
        oks.append(False)
        continue
      seq = self.seqs[sid]
      need = _ceil(seq["tokens"] + n, bs) - _ceil(seq["tokens"], bs)
      cum += need
      cumz += need if zero else 0
      oks.append(need == 0 or (cum <= free0 and cumz <= zroom))
    for (sid, n), ok in zip(reqs, oks):
      if ok:
        seq = self.seqs[sid]
        need = _ceil(seq["tokens"] + n, bs) - _ceil(seq["tokens"], bs)
        for _ in range(need):
          b = self._pop()
          self.ref[b] = 1
          seq["blocks"].append(b)
          if zero:
            self.zero.append(b)
        seq["tokens"] += n
    return oks

  def admit(self, reqs):
    """reqs: (sid, prompt_len, digests (list of tuples), load_tokens)."""
    bs, spec = self.spec.block_size, self.spec
    parked = self._parked_blocks()
    free0, zroom = len(self.queue), spec.max_zero_list - len(self.zero)
    plans, claimed = [], set()
    cum = cumz = 0
    for sid, plen, digests, load in reqs:
      if sid < 0:
        plans.append(None)
        continue
      hits = []
      if spec.enable_prefix_caching:
        cap = max(plen - 1, 0) // bs
        for j, d in enumerate(digests[:cap]):
          b = self.index.get(self._slot(d))
          if b is None or self.hash.get(b) != d or b in parked:
            break
          hits.append(b)
      first = [b for b in hits if self.ref[b] == 0 and b not in claimed]
      claimed.update(first)
      nb = _ceil(plen, bs)
      load_end = max(len(hits) * bs, load)
      zero_from = max(len(hits), _ceil(load_end, bs))
      cum += nb - len(hits) + len(first)
      cumz += (nb - zero_from) if spec.zero_new_blocks else 0
      ok = cum <= free0 and cumz <= zroom
      plans.append(dict(hits=hits, first=first, nb=nb, load_end=load_end, zero_from=zero_from, ok=ok))
    oks = [p is not None and p["ok"] for p in plans]
    # Hits of every admitted request are taken before any block is popped.
    for p, ok in zip(plans, oks):
      if ok:
        for b in p["hits"]:
          self.ref[b] += 1
        for b in p["first"]:
          self.queue.remove(b)
    regs = []
    for (sid, plen, digests, load), p, ok in zip(reqs, plans, oks):
      if not ok:
        continue
      blocks = list(p["hits"])
      for j in range(len(p["hits"]), p["nb"]):
        b = self._pop()
        self.ref[b] = 1
        blocks.append(b)
        if spec.zero_new_blocks and j >= p["zero_from"]:
          self.zero.append(b)
      h = len(p["hits"])
      self.seqs[sid] = dict(blocks=blocks, tokens=plen, loading=p["load_end"] > h * bs,
                            load_start=h * bs, load_end=p["load_end"])
      if spec.enable_prefix_caching:
        regs += [(blocks[j], digests[j]) for j in range(p["zero_from"], min(plen // bs, len(digests)))]
    by_slot = {}
    for b, d in regs:
      by_slot.setdefault(self._slot(d), []).append((b, d))
    for slot, cands in by_slot.items():
      if slot not in self.index:
        b, d = min(cands)
        self.index[slot] = b
        self.hash[b] = d
    hit_tokens = [len(p["hits"]) * bs if ok else 0 for p, ok in zip(plans, oks)]
    return oks, hit_tokens

  def free(self, sids):
    oks = []
    for sid in sids:
      if sid < 0:
        oks.append(False)
        continue
      seq = self.seqs.pop(sid)
      for b in reversed(seq["blocks"]):
        self.ref[b] -= 1
        if self.ref[b] == 0:
          self._release(b)
      oks.append(True)
    return oks

  def advance_step(self):
    self.step += 1
    return self.step

  def mark_processed(self, step):
    due = [b for b, s in self.parked if s <= step]
    self.parked = [(b, s) for b, s in self.parked if s > step]
    for b in due:
      self._push(b)
    self.processed = max(self.processed, step)
    return len(due)

  def complete_loads(self, reqs):
    bs, spec = self.spec.block_size, self.spec
    zroom, troom = spec.max_zero_list - len(self.zero), spec.max_tails - len(self.tails)
    cumz = cumt = 0
    plans = []
    for sid, v in reqs:
      if sid < 0:
        plans.append(None)
        continue
      seq = self.seqs[sid]
      stop, end = seq["load_start"] + v, seq["load_end"]
      zero = list(range(stop // bs, _ceil(end, bs))) if stop < end else []
      tail = [(stop // bs, stop % bs)] if stop == end and stop % bs else []
      if not spec.zero_new_blocks:
        zero, tail = [], []
      cumz += len(zero)
      cumt += len(tail)
      ok = (not zero or cumz <= zroom) and (not tail or cumt <= troom)
      plans.append((zero, tail) if ok else None)
    oks = []
    for (sid, v), plan in zip(reqs, plans):
      oks.append(plan is not None)
      if plan is None:
        continue
      seq = self.seqs[sid]
      self.zero += [seq["blocks"][j] for j in plan[0]]
      self.tails += [(seq["blocks"][j], valid) for j, valid in plan[1]]
      seq["loading"] = False
    return oks

  def clear_pending(self):
    self.zero, self.tails = [], []

  def slot_mapping(self, reqs, num_slots):
    bs, out = self.spec.block_size, []
    for sid, n in reqs:
      if sid < 0 or sid not in self.seqs:
        continue
      seq = self.seqs[sid]
      for pos in range(seq["tokens"] - min(n, seq["tokens"]), seq["tokens"]):
        out.append(seq["blocks"][pos // bs] * bs + pos % bs)
    return (out + [-1] * num_slots)[:num_slots]


def assert_matches(model, state):
  """Asserts that a device `PoolState` is exactly the model's state."""
  import numpy as np

  import jax

  spec = model.spec
  state = jax.device_get(state)  # one transfer; the fields below are NumPy slices
  s = state.fields()
  nf = int(s["num_free"])
  queue = np.asarray(state.ordered_free_queue())
  assert queue[:nf].tolist() == model.queue, (queue[:nf].tolist(), model.queue)
  assert (queue[nf:] == -1).all()
  assert int((s["free_queue"] >= 0).sum()) == nf  # the ring holds nothing else
  assert s["ref_count"].tolist() == model.ref
  hashed = set(np.flatnonzero(s["hashed"]).tolist())
  assert hashed == set(model.hash), (hashed, set(model.hash))
  for b, d in model.hash.items():
    assert tuple(s["block_hash"][b].tolist()) == d
  index = {i: int(b) for i, b in enumerate(s["hash_table"]) if b >= 0}
  assert index == model.index
  npk = int(s["num_parked"])
  parked, parked_step = (np.asarray(x) for x in state.ordered_parked())
  assert list(zip(parked[:npk].tolist(), parked_step[:npk].tolist())) == model.parked
  for sid in range(spec.max_seqs):
    seq = model.seqs.get(sid)
    row = s["block_table"][sid].tolist()
    if seq is None:
      assert not s["active"][sid] and row == [0] * spec.max_blocks_per_seq
      continue
    assert s["active"][sid]
    assert row == seq["blocks"] + [0] * (spec.max_blocks_per_seq - len(seq["blocks"])), (sid, row, seq)
    assert int(s["num_tokens"][sid]) == seq["tokens"]
    assert bool(s["loading"][sid]) == seq["loading"]
    if seq["loading"]:
      assert (int(s["load_start"][sid]), int(s["load_end"][sid])) == (seq["load_start"], seq["load_end"])
  nz, nt = int(s["num_zero"]), int(s["num_tails"])
  assert s["zero_list"][:nz].tolist() == model.zero and (s["zero_list"][nz:] == -1).all()
  assert list(zip(s["tail_ids"][:nt].tolist(), s["tail_valid"][:nt].tolist())) == model.tails
  assert (s["tail_ids"][nt:] == -1).all()
  assert int(s["step"]) == model.step and int(s["processed"]) == model.processed
