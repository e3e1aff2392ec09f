"""What every part of the DistServeDeployment spec shares: the error and the base model.

A separate module so that the spec's parts (`spec`, `spec_pods`) can live in files of a
readable length without importing each other in a circle.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class SpecError(ValueError):
    """A spec that is not valid; the message names each field and what was expected."""


class SpecModel(BaseModel):
    """Base: camelCase aliases, unknown fields refused, values checked on assignment."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
    )
