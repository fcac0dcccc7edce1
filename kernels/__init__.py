"""Pallas Mosaic GPU kernels of jaxkv, one folder per op; imported as jaxkv.kernels."""

from jaxkv.kernels.mla_decode import mla_decode as mla_decode
from jaxkv.kernels.mla_decode import mla_decode_plan as mla_decode_plan
from jaxkv.kernels.mla_decode import mla_decode_reference as mla_decode_reference
from jaxkv.kernels.write_kv import write_kv as write_kv
from jaxkv.kernels.write_kv import write_kv_reference as write_kv_reference
from jaxkv.kernels.zero_blocks import zero_blocks as zero_blocks
from jaxkv.kernels.zero_blocks import zero_blocks_reference as zero_blocks_reference
from jaxkv.kernels.sparse_mla_decode import sparse_mla_decode as sparse_mla_decode
from jaxkv.kernels.sparse_mla_decode import sparse_mla_decode_reference as sparse_mla_decode_reference
