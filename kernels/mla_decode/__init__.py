"""Dense paged MLA decode (absorbed, 576/512) as a Mosaic GPU kernel."""

from .combine import combine_splits as combine_splits
from .config import MLADecodeConfig as MLADecodeConfig
from .config import default_config as default_config
from .config import heuristic_config as heuristic_config
from .plan import MLADecodePlan as MLADecodePlan
from .plan import mla_decode_plan as mla_decode_plan
from .reference import mla_decode_reference as mla_decode_reference
from .wrapper import mla_decode as mla_decode
