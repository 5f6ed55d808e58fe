"""Building a frozen attrs record as its `__init__` does, for builders that skip its checks.

A transition whose result is derived row for row from checked records sets
the fields itself: `new_record(cls)`, then each field through `put_field`
(by name) or, on a hot path, through its slot's own setter from
`slot_setters`, which gets past attrs' frozen check without
`object.__setattr__`'s lookup of the slot by name (a quarter cheaper).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

__all__ = ["new_record", "put_field", "slot_setters"]

new_record: Final = object.__new__
put_field: Final = object.__setattr__  # what attrs' frozen __init__ does


def slot_setters(cls: type, *names: str) -> tuple[Callable[[object, object], None], ...]:
    """The setters of `cls`'s slots `names`, in that order (a slotted attrs class's fields)."""
    return tuple(cls.__dict__[name].__set__ for name in names)
