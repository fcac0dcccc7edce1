"""Dimension names and array aliases used in every jaxkv signature.

jaxtyping reads the strings; the names below are the only spellings used.
"""

from __future__ import annotations

from jaxtyping import Array, Bool, Float, Int, Shaped

# Logical axes of a cache (see the layouts of zero_blocks).
LAYERS = "layers"
BLOCKS = "num_blocks"
KV_HEADS = "kv_heads"
SLOTS = "block_size"
CHANNELS = "channels"

# Request-side axes.
BATCH = "batch"
HEADS = "heads"
TOKENS = "tokens"
MAX_SEQS = "max_seqs"
MAX_BLOCKS = "max_blocks"
TOPK = "topk"

# MLA: 512 latent channels + 64 RoPE channels.
MLA_HEAD_DIM = 576
MLA_LATENT_DIM = 512
MLA_ROPE_DIM = 64

BlockTable = Int[Array, f"{BATCH} {MAX_BLOCKS}"]
SeqLens = Int[Array, f"{BATCH}"]
SlotMapping = Int[Array, f"{TOKENS}"]
BlockIds = Int[Array, "ids"]
MLACache = Shaped[Array, f"{BLOCKS} {SLOTS} {MLA_HEAD_DIM}"]
MLAQuery = Float[Array, f"{BATCH} {HEADS} {MLA_HEAD_DIM}"]
Lse = Float[Array, f"{BATCH} {HEADS}"]
Mask = Bool[Array, "..."]
