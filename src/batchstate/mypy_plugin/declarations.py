"""The mypy plugin's class hook: a column set declares only columns the library carries.

Run for every class with `Columns` among its bases, once its body is
analysed: each annotated field, its own or inherited from an attrs base
that is not a column set, must be `Mirrored[S]`, `DeviceOnly` or
`HostColumn[S]` (`npt.NDArray[S]`) with `S` one of `SCALAR_NAMES`, and the
class must be decorated with a frozen attrs decorator of its own. These are
the rules `_columns._read_fields` applies when a transition first meets the
class; the plugin applies them where it is written.
"""

from __future__ import annotations

from typing import Final

from mypy.errorcodes import ErrorCode
from mypy.messages import format_type
from mypy.nodes import (
    AssignmentStmt,
    CallExpr,
    ClassDef,
    Expression,
    NameExpr,
    RefExpr,
    TypeAlias,
    TypeInfo,
    Var,
)
from mypy.options import Options
from mypy.plugin import ClassDefContext, SemanticAnalyzerPluginInterface
from mypy.plugins.attrs import (
    attr_class_makers,
    attr_dataclass_makers,
    attr_define_makers,
    attr_frozen_makers,
)
from mypy.types import (
    Instance,
    PlaceholderType,
    ProperType,
    TupleType,
    Type,
    UnboundType,
    UnionType,
    get_proper_type,
)

from batchstate.base.scalars import SCALAR_NAMES

__all__ = ["COLUMNS", "COLUMN_SET", "check_declaration"]

COLUMNS: Final = "batchstate.columns.columns.Columns"
COLUMN_SET: Final = ErrorCode(
    "column-set", "A column set declares only columns batchstate carries", "batchstate"
)
_MIRRORED: Final = "batchstate.base.mirrored.Mirrored"
_DEVICE_ONLY: Final = "batchstate.base.mirrored.DeviceOnly"
_NDARRAY: Final = "numpy.ndarray"
_KINDS: Final = "a column is Mirrored[S], DeviceOnly or HostColumn[S]"
_SCALARS: Final = "S one of " + ", ".join(f"np.{name}" for name in SCALAR_NAMES)


def check_declaration(ctx: ClassDefContext) -> None:
    """Report each field of a column set that is not a column, and a set that is not frozen."""
    fields = _fields(ctx.cls)
    if any(_unresolved(annotation) for _, annotation, _ in fields):
        if not ctx.api.final_iteration:
            ctx.api.defer()  # a name the annotations use is not analysed yet: come back
            return
        # On the last pass a name still unresolved is mypy's own error: leave it out.
        fields = [field for field in fields if not _unresolved(field[1])]
    name = ctx.cls.name
    if not _frozen_attrs(ctx.cls):
        ctx.api.fail(
            f'Column set "{name}" must be a frozen attrs class of its own'
            " (decorate it with @attrs.frozen(eq=False))",
            ctx.cls,
            code=COLUMN_SET,
        )
    scalars = _scalar_types(ctx.api)
    for field, annotation, statement in fields:
        problem = _problem(get_proper_type(annotation), scalars, ctx.api.options)
        if problem:
            ctx.api.fail(f"{name}.{field}: {problem}", statement, code=COLUMN_SET)
    for base, field, annotation in _inherited(ctx.cls.info):
        problem = _problem(get_proper_type(annotation), scalars, ctx.api.options)
        if problem:
            ctx.api.fail(f"{name}.{field} (a field of {base}): {problem}", ctx.cls, code=COLUMN_SET)


def _inherited(info: TypeInfo) -> list[tuple[str, str, Type]]:
    # The fields a set inherits from attrs classes that are not column sets (a set's
    # own base sets were checked where they were written): attrs makes a decorated
    # base's annotated attributes fields of the set too. (base name, field, its type)
    found: list[tuple[str, str, Type]] = []
    for base in info.mro[1:]:
        if base.has_base(COLUMNS) or not _attrs_class(base.defn):
            continue
        found.extend(
            (base.name, field, annotation)
            for field, annotation, _ in _fields(base.defn)
            if not _unresolved(annotation)
        )
    return found


def _attrs_class(cls: ClassDef) -> bool:
    # Decorated by any of attrs' class makers.
    makers = attr_class_makers | attr_dataclass_makers | attr_define_makers | attr_frozen_makers
    for decorator in cls.decorators:
        callee = decorator.callee if isinstance(decorator, CallExpr) else decorator
        if isinstance(callee, RefExpr) and callee.fullname in makers:
            return True
    return False


def _fields(cls: ClassDef) -> list[tuple[str, Type, AssignmentStmt]]:
    # The annotated attributes of the class body: what attrs makes fields (not ClassVars).
    found = []
    for statement in cls.defs.body:
        if not isinstance(statement, AssignmentStmt) or statement.type is None:
            continue
        for target in statement.lvalues:
            if not isinstance(target, NameExpr):
                continue
            node = cls.info.names.get(target.name)
            if node is not None and isinstance(node.node, Var) and node.node.is_classvar:
                continue
            found.append((target.name, statement.type, statement))
    return found


def _unresolved(annotation: Type) -> bool:
    # A name the semantic analysis has not bound yet, anywhere in the type.
    proper = get_proper_type(annotation)
    if isinstance(proper, UnboundType | PlaceholderType):
        return True
    if isinstance(proper, Instance):
        return any(_unresolved(arg) for arg in proper.args)
    if isinstance(proper, UnionType | TupleType):
        return any(_unresolved(item) for item in proper.items)
    return False


def _problem(annotation: ProperType, scalars: list[ProperType], options: Options) -> str | None:
    # What is wrong with a field's type, in words; None for a column.
    if not isinstance(annotation, Instance):
        return f"{_KINDS}, got {format_type(annotation, options)}"
    fullname = annotation.type.fullname
    if fullname == _DEVICE_ONLY:
        return None
    if fullname == _MIRRORED:
        scalar = get_proper_type(annotation.args[0])
    elif fullname == _NDARRAY and len(annotation.args) == 2:
        dtype = get_proper_type(annotation.args[1])
        if not isinstance(dtype, Instance) or not dtype.args:
            return f"{_KINDS}, got an array of {format_type(dtype, options)}"
        scalar = get_proper_type(dtype.args[0])
    else:
        return f"{_KINDS}, got {format_type(annotation, options)}"
    if _admitted(scalar, scalars):
        return None
    kind = "Mirrored" if fullname == _MIRRORED else "HostColumn"
    return f"{kind}[S] with {_SCALARS}, got {format_type(scalar, options)}"


def _scalar_types(api: SemanticAnalyzerPluginInterface) -> list[ProperType]:
    # numpy's own types for SCALAR_NAMES, as its stubs declare them (aliases or classes).
    found: list[ProperType] = []
    for name in SCALAR_NAMES:
        symbol = api.lookup_fully_qualified_or_none(f"numpy.{name}")
        node = symbol.node if symbol is not None else None
        if isinstance(node, TypeAlias):
            found.append(get_proper_type(node.target))
        elif isinstance(node, TypeInfo):
            found.append(Instance(node, []))
    return found


def _admitted(scalar: ProperType, scalars: list[ProperType]) -> bool:
    # One of the admitted types; a platform-sized one (np.intp: 32 or 64 bits) when each
    # of its widths is.
    if isinstance(scalar, Instance):
        for index, arg in enumerate(scalar.args):
            widths = get_proper_type(arg)
            if isinstance(widths, UnionType):
                return all(
                    _admitted(
                        scalar.copy_modified(
                            args=[*scalar.args[:index], width, *scalar.args[index + 1 :]]
                        ),
                        scalars,
                    )
                    for width in widths.items
                )
    return any(_same(scalar, admitted) for admitted in scalars)


def _same(scalar: ProperType, admitted: ProperType) -> bool:
    # The same numpy type: the same class and, for a sized one, the same bit width. A class
    # admitted bare (numpy 2's `float64`, `bool`) matches whatever its own arguments are.
    if not isinstance(scalar, Instance) or not isinstance(admitted, Instance):
        return False
    if scalar.type.fullname != admitted.type.fullname:
        return False
    if not admitted.args:
        return True
    return len(scalar.args) == len(admitted.args) and all(
        _same(get_proper_type(mine), get_proper_type(theirs))
        for mine, theirs in zip(scalar.args, admitted.args, strict=True)
    )


def _frozen_attrs(cls: ClassDef) -> bool:
    # Decorated by attrs' frozen makers, or by another attrs maker with `frozen=True`.
    for decorator in cls.decorators:
        callee = decorator.callee if isinstance(decorator, CallExpr) else decorator
        name = callee.fullname if isinstance(callee, RefExpr) else ""
        if name in attr_frozen_makers:
            return _keyword(decorator, "frozen") is not False
        if name in attr_class_makers | attr_dataclass_makers | attr_define_makers:
            return _keyword(decorator, "frozen") is True
    return False


def _keyword(decorator: Expression, name: str) -> bool | None:
    # A decorator call's literal True/False keyword argument; None when not given.
    if not isinstance(decorator, CallExpr):
        return None
    for argument, keyword in zip(decorator.args, decorator.arg_names, strict=True):
        if keyword == name and isinstance(argument, NameExpr):
            return {"builtins.True": True, "builtins.False": False}.get(argument.fullname)
    return None
