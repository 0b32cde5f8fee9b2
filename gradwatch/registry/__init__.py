"""What gradwatch measures, declared once.

- ``states.py``: every state of the on-device buffer (shape, reduction across ranks, how a rank's
  values enter the union of a split model);
- ``statistics.py``: every statistic of a window (its decoding from those states, where and under
  which tag it is written, how the tab draws it);
- ``outputs.py``: the output-statistic family (act_rms, act_zero_fraction): what the taps
  accumulate on sampled steps, and how it decodes.

The layout (``capture/layout.py``), the union gather (``distributed/mesh.py``), the decoder
(``flush/decode.py``), the scalars (``sinks/scalars.py``) and the tab (``dashboard/data.py``)
read these tables rather than naming statistics themselves.
"""

from .outputs import OUTPUT_STATISTICS, OutputStatistic, accumulate_all, accumulator_count, decode_all
from .states import STATES, Sizes, StateDecl, declare_states
from .statistics import STATISTICS, Decoding, Statistic, all_statistics, written

__all__ = [
    "OUTPUT_STATISTICS", "OutputStatistic", "accumulate_all", "accumulator_count", "decode_all",
    "STATES", "Sizes", "StateDecl", "declare_states", "STATISTICS", "Decoding", "Statistic", "all_statistics", "written",
]  # fmt: skip
