"""What the user-facing models share: strict pydantic models, and names that are DNS labels."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class StrictModel(BaseModel):
    """User-facing config: a typo must be an error, not a silently ignored field."""

    model_config = ConfigDict(extra="forbid", frozen=True)
