"""The numpy scalar types a column holds: one list for the run-time check and the mypy plugin.

Each is a fixed-size type that `torch.from_numpy` converts, so a mirrored
column's device side has the host side's dtype. The names are numpy's
(`np.bool_` exists in numpy 1 and 2); this module imports nothing, so the
mypy plugin reads it without loading numpy or torch.
"""

from __future__ import annotations

from typing import Final

__all__ = ["SCALAR_NAMES"]

SCALAR_NAMES: Final = (
    "bool_",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
