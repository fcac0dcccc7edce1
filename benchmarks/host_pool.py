"""A straightforward host-side block pool: a doubly linked free list, as engines keep on the CPU.

Same policy as the jitted pool (front/back placement, reverse freeing,
chained prefix hashes, eviction on pop, zero list), written the way a
production scheduler does it in Python: one object per block, O(1) list
surgery, a dict from block hash to block. It is the peer the benchmark
compares the jitted scheduler step against.
"""

from __future__ import annotations


class Block:
  __slots__ = ("id", "prev", "next", "ref", "hash")

  def __init__(self, i):
    self.id, self.prev, self.next, self.ref, self.hash = i, None, None, 0, None


class FreeList:
  """Doubly linked list of blocks with sentinels; every operation is O(1)."""

  def __init__(self, blocks):
    self.head, self.tail = Block(-1), Block(-1)
    self.head.next, self.tail.prev = self.tail, self.head
    self.size = 0
    for b in blocks:
      self.append(b)

  def _link(self, b, before):
    after = before.next
    b.prev, b.next = before, after
    before.next = after.prev = b
    self.size += 1

  def append(self, b):
    self._link(b, self.tail.prev)

  def appendleft(self, b):
    self._link(b, self.head)

  def remove(self, b):
    b.prev.next, b.next.prev = b.next, b.prev
    b.prev = b.next = None
    self.size -= 1

  def popleft(self):
    b = self.head.next
    self.remove(b)
    return b


class HostPool:
  """Block pool with prefix caching and a zero list, one Python object per block."""

  def __init__(self, num_blocks, block_size, zero_new_blocks=True):
    self.bs = block_size
    self.blocks = [Block(i) for i in range(num_blocks)]
    self.free = FreeList(self.blocks[1:])
    self.index = {}
    self.seqs = {}
    self.zero = []
    self.zero_new_blocks = zero_new_blocks

  def _pop(self):
    b = self.free.popleft()
    if b.hash is not None:
      del self.index[b.hash]
      b.hash = None
    b.ref = 1
    if self.zero_new_blocks:
      self.zero.append(b.id)
    return b

  def free_seq(self, sid):
    blocks, _ = self.seqs.pop(sid)
    for b in reversed(blocks):
      b.ref -= 1
      if b.ref == 0:
        if b.hash is None:
          self.free.appendleft(b)
        else:
          self.free.append(b)

  def admit(self, sid, tokens, prompt_len):
    bs = self.bs
    hashes, parent = [], None
    for j in range(prompt_len // bs):
      parent = hash((parent, tuple(tokens[j * bs:(j + 1) * bs])))
      hashes.append(parent)
    hits = []
    for h in hashes[:max(prompt_len - 1, 0) // bs]:
      b = self.index.get(h)
      if b is None:
        break
      hits.append(b)
    nb = -(-prompt_len // bs)
    idle = sum(1 for b in hits if b.ref == 0)
    if nb - len(hits) + idle > self.free.size:
      return False
    for b in hits:
      if b.ref == 0:
        self.free.remove(b)
      b.ref += 1
    blocks = hits + [self._pop() for _ in range(nb - len(hits))]
    for j in range(len(hits), len(hashes)):
      if hashes[j] not in self.index:
        blocks[j].hash = hashes[j]
        self.index[hashes[j]] = blocks[j]
    self.seqs[sid] = [blocks, prompt_len]
    return True

  def grow(self, sid, n):
    seq = self.seqs[sid]
    need = -(-(seq[1] + n) // self.bs) - len(seq[0])
    if need > self.free.size:
      return False
    seq[0].extend(self._pop() for _ in range(need))
    seq[1] += n
    return True

  def step(self, finish, arrivals, running):
    """One scheduler step: free, admit, grow every running sequence by one token.

    Returns the slot mapping of the decode tokens and the zero list.
    """
    for sid in finish:
      self.free_seq(sid)
    for sid, tokens, plen in arrivals:
      self.admit(sid, tokens, plen)
    slots = []
    for sid in running:
      if self.grow(sid, 1):
        blocks, t = self.seqs[sid]
        slots.append(blocks[(t - 1) // self.bs].id * self.bs + (t - 1) % self.bs)
    zero, self.zero = self.zero, []
    return slots, zero
