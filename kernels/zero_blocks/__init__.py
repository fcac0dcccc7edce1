"""zero_blocks: one launch that zeroes new blocks and block tails, byte-exact."""

from jaxkv.kernels.zero_blocks.config import ZeroBlocksConfig as ZeroBlocksConfig
from jaxkv.kernels.zero_blocks.reference import (
    zero_blocks_reference as zero_blocks_reference,
)
from jaxkv.kernels.zero_blocks.wrapper import zero_blocks as zero_blocks
