"""The constrained value types the config's sections share: names and positive numbers."""

from __future__ import annotations

from typing import Annotated

import msgspec

# A subject token's pattern (broker_config/subjects.py): endpoint and tenant names are
# parts of subjects.
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
Positive = Annotated[float, msgspec.Meta(gt=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
