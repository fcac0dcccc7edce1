"""write_kv: scatter new tokens' KV into their cache slots, skipping padding."""

from jaxkv.kernels.write_kv.config import WriteKVConfig as WriteKVConfig
from jaxkv.kernels.write_kv.reference import LAYOUTS as LAYOUTS
from jaxkv.kernels.write_kv.reference import write_kv_reference as write_kv_reference
from jaxkv.kernels.write_kv.wrapper import write_kv as write_kv
