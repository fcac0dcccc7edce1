"""Runs one decode op at one shape a few times, untimed, for `ncu`'s own
profile (source-level stall samples):

  ncu -k regex:sparse_mla_decode_mosaic -c 1 $SRC python probe_ncu.py sparse 83 128
  ncu -k regex:jaxkv_mla_decode -c 1 $SRC python probe_ncu.py dense 128 64 4096

with SRC="--section SourceCounters --page source --print-source sass --csv".

sparse B H: top-k 2048 over 4096 blocks of 64, select. dense B H CTX: lengths
uniform in [CTX/2, 3 CTX/2), block 64, select.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kernels import mla_decode, sparse_mla_decode

op, batch, heads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(k[0], (batch, heads, 576), jnp.bfloat16)
if op == "sparse":
  blocks = 4096
  cache = jax.random.normal(k[1], (blocks, 64, 576), jnp.bfloat16)
  idx = jax.random.randint(k[2], (batch, 2048), 0, blocks * 64, jnp.int32)
  fn = jax.jit(lambda q, c, i: sparse_mla_decode(q, c, i, sm_scale=576 ** -0.5,
                                                 mask_mode="select"))
  args = (q, cache, idx)
else:
  ctx = int(sys.argv[4])
  rng = np.random.default_rng(0)
  lens = rng.integers(ctx // 2, 3 * ctx // 2, batch)
  per_row = -(-lens // 64)
  max_blocks = int(per_row.max())
  perm = rng.permutation(int(per_row.sum())) + 1  # block 0 is the null block
  table = np.zeros((batch, max_blocks), np.int32)
  at = 0
  for r, n in enumerate(per_row):
    table[r, :n] = perm[at:at + n]
    at += n
  cache = jax.random.normal(k[1], (at + 1, 64, 576), jnp.bfloat16)
  fn = jax.jit(lambda q, c, t, s: mla_decode(q, c, t, s, sm_scale=576 ** -0.5,
                                             mask_mode="select"))
  args = (q, cache, jnp.asarray(table), jnp.asarray(lens, jnp.int32))
for _ in range(3):
  out, lse = fn(*args)
jax.block_until_ready(out)
print("ok", out.shape, bool(jnp.isfinite(out).all()))
