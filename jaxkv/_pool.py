"""The block pool's public names in one place (re-exported by `jaxkv`)."""

from ._fence import advance_step as advance_step
from ._fence import mark_processed as mark_processed
from ._pool_alloc import admit as admit
from ._pool_alloc import grow as grow
from ._pool_check import assert_pool_valid as assert_pool_valid
from ._pool_check import check_pool as check_pool
from ._pool_free import abort as abort
from ._pool_free import free as free
from ._pool_load import complete_loads as complete_loads
from ._pool_slots import clear_pending as clear_pending
from ._pool_slots import slot_mapping as slot_mapping
from ._pool_spec import PoolSpec as PoolSpec
from ._pool_state import PoolState as PoolState
from ._pool_state import init_pool as init_pool
from ._prefix import hash_prompt_blocks as hash_prompt_blocks
