"""Runs one decode op at one shape a few times, untimed, for `ncu`'s own
profile (source-level stall samples):

  ncu -k regex:sparse_mla_decode_mosaic -c 1 $SRC python probe_ncu.py sparse 83:128
  ncu -k regex:jaxkv_mla_decode -c 1 $SRC python probe_ncu.py dense 128:64:4096

with SRC="--section SourceCounters --page source --print-source sass --csv".

sparse B:H: the sparse bench's inputs (`check_sparse_mla_decode.inputs`: top-k
2048, no -1), select. dense B:H:CTX: the dense bench's problem
(`bench_mla_decode.shape_problem`) with its default plan, select.
"""

import sys

import jax
import jax.numpy as jnp

import bench_mla_decode as B
import check_sparse_mla_decode as S
from jaxkv.kernels import mla_decode, sparse_mla_decode

op, shape = sys.argv[1], sys.argv[2]
if op == "sparse":
  batch, heads = map(int, shape.split(":"))
  args = S.inputs(batch, heads, 0.0)
  fn = jax.jit(lambda q, c, i: sparse_mla_decode(q, c, i, sm_scale=S.SCALE, mask_mode="select"))
else:
  args = B.shape_problem(shape)
  fn = jax.jit(lambda q, c, t, s, p: mla_decode(q, c, t, s, sm_scale=B.D**-0.5, plan=p,
                                                mask_mode="select"))
for _ in range(3):
  out, lse = fn(*args)
jax.block_until_ready(out)
print("ok", out.shape, bool(jnp.isfinite(out).all()))
