"""A field read from the file as one shape and held as the runtime object made of it (a
replica, a session source, a request class, a split rule), written back as the file spells it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import GetPydanticSchema
from pydantic_core import core_schema


def held_as(entry: type, runtime: type | None, build: Callable[[Any], Any], dump: Callable[[Any], Any]) -> Any:
    """A field read from the file as ``entry`` and held as the ``runtime`` object ``build``
    makes of it (what the request layer matches with); a ``runtime`` object given in code is
    taken as it is (None: everything is read as ``entry``). ``dump`` writes it back as the file
    spells it."""

    def held(value: Any, validate: Callable[[Any], Any]) -> Any:
        return value if runtime is not None and isinstance(value, runtime) else build(validate(value))

    def schema(_source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_wrap_validator_function(
            held,
            handler.generate_schema(entry),
            serialization=core_schema.plain_serializer_function_ser_schema(dump),
        )

    return GetPydanticSchema(schema)
