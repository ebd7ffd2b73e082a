"""The two ways a run holds its budget, named once.

* ``prefill``: the context is read (in chunks, or at once), then compressed once to the budget; decoding appends
  without evicting. Peak memory is the full context.
* ``streaming``: the budget holds the whole time: after every chunk and every decoded token each layer is cut back to
  its budget, so the cache never holds more than budget + chunk tokens per layer.
"""

from __future__ import annotations

from typing import Literal, get_args

Mode = Literal["prefill", "streaming"]
MODES: tuple[Mode, ...] = get_args(Mode)
