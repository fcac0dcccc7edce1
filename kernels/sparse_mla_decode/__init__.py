"""sparse_mla_decode: DeepSeek sparse-attention (top-k) MLA decode, NaN-safe in "select" mode."""

from jaxkv.kernels.sparse_mla_decode.config import (
    SparseMLADecodeConfig as SparseMLADecodeConfig,
)
from jaxkv.kernels.sparse_mla_decode.reference import (
    sparse_mla_decode_reference as sparse_mla_decode_reference,
)
from jaxkv.kernels.sparse_mla_decode.wrapper import sparse_mla_decode as sparse_mla_decode
