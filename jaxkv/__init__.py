"""jaxkv: a NaN-safe paged KV cache for LLM inference in JAX.

Kernels live in `jaxkv.kernels`; this package holds the specs, the backend
registry and zeroing policy, the block pool, capture and the scheduler step.
"""

from ._backends import AttentionBackend as AttentionBackend
from ._backends import CompositeBackend as CompositeBackend
from ._backends import get_backend as get_backend
from ._backends import register_backend as register_backend
from ._backends import registered_backends as registered_backends
from ._capture import CapturedStep as CapturedStep
from ._capture import capture as capture
from ._capture import dummy_batch as dummy_batch
from ._capture import pad_batch as pad_batch
from ._config import ModelConfig as ModelConfig
from ._config import list_model_configs as list_model_configs
from ._config import load_model_config as load_model_config
from ._dcp import local_valid_slots as local_valid_slots
from ._groups import HybridPoolSpec as HybridPoolSpec
from ._groups import KVCacheGroup as KVCacheGroup
from ._null_block import assert_null_block_clean as assert_null_block_clean
from ._null_block import check_null_block_clean as check_null_block_clean
from ._null_block import reset_null_block as reset_null_block
from ._slots import slots_from_block_table as slots_from_block_table
from ._pool import PoolSpec as PoolSpec
from ._pool import PoolState as PoolState
from ._pool import init_pool as init_pool
from ._pool import grow as grow
from ._pool import admit as admit
from ._pool import free as free
from ._pool import abort as abort
from ._pool import complete_loads as complete_loads
from ._pool import advance_step as advance_step
from ._pool import mark_processed as mark_processed
from ._pool import slot_mapping as slot_mapping
from ._pool import clear_pending as clear_pending
from ._pool import hash_prompt_blocks as hash_prompt_blocks
from ._pool import assert_pool_valid as assert_pool_valid
from ._pool import check_pool as check_pool
from ._specs import FullAttentionSpec as FullAttentionSpec
from ._specs import KVCacheSpec as KVCacheSpec
from ._specs import MambaSpec as MambaSpec
from ._specs import MLAAttentionSpec as MLAAttentionSpec
from ._specs import SlidingWindowSpec as SlidingWindowSpec
from ._specs import UniformTypeSpec as UniformTypeSpec
from ._specs import merge as merge
from ._specs import project_uniform_type as project_uniform_type
from ._specs import spec_dtypes as spec_dtypes
from ._zeroing import ZeroingDecision as ZeroingDecision
from ._zeroing import group_requires_zeroing as group_requires_zeroing
from ._zeroing import pool_zeroing_plan as pool_zeroing_plan

__version__ = "0.1.0"
