"""The mypy plugin's call hook: the column set of a call comes from its arguments.

mypy infers a generic function's type variables from the call's context
before its arguments. Nested in another generic call, a call whose arguments
disagree on the column set (`decode(merge(f, e), pools)` with `f` a
`Filtered[Sampling]` and `e` an `Extended[NoColumns]`) is first checked with
its errors hidden, gets `Any` for its column set, and hands that `Any` to the
outer call; when mypy checks it again, the outer call's `Running[Any]` is its
context, the context solves the column set as `Any`, and no error is left.
A call passed where `Any` is expected is solved the same way.

For each function of the package generic over a column set, this hook
solves that set again from the argument types alone: arguments that
disagree are an `arg-type` error naming each one's set, and arguments that
agree give the call its return type with that set, whatever the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from mypy.errorcodes import ARG_TYPE
from mypy.expandtype import expand_type
from mypy.infer import ArgumentInferContext, infer_function_type_arguments, infer_type_arguments
from mypy.messages import format_type
from mypy.nodes import (
    ArgKind,
    Decorator,
    Expression,
    FuncDef,
    ListExpr,
    OverloadedFuncDef,
    SetExpr,
    StarExpr,
    SymbolNode,
    TupleExpr,
)
from mypy.plugin import FunctionContext
from mypy.subtypes import is_same_type
from mypy.typeops import get_all_type_vars, make_simplified_union
from mypy.types import (
    AnyType,
    CallableType,
    Instance,
    Overloaded,
    TupleType,
    Type,
    TypeOfAny,
    TypeVarId,
    TypeVarType,
    UninhabitedType,
    get_proper_type,
)

__all__ = ["check_call", "generic_signatures"]

_COLUMNS: Final = "batchstate.columns.columns.Columns"


def generic_signatures(node: SymbolNode | None) -> tuple[CallableType, ...]:
    """A function's signatures (one per overload) when one is generic over a column set."""
    if isinstance(node, Decorator):
        node = node.func
    signature = node.type if isinstance(node, FuncDef | OverloadedFuncDef) else None
    items = (
        signature.items
        if isinstance(signature, Overloaded)
        else [signature]
        if isinstance(signature, CallableType)
        else []
    )
    return tuple(items) if any(_column_vars(item) for item in items) else ()


def check_call(ctx: FunctionContext, name: str, signatures: Sequence[CallableType]) -> Type:
    """Report arguments of different column sets; give the call the set they agree on."""
    matching = [item for item in signatures if item.arg_names == ctx.callee_arg_names]
    if len(matching) != 1 or not _column_vars(matching[0]):
        return ctx.default_return_type
    signature = matching[0]
    actuals = [
        [_from_items(ctx, expression, given) for expression, given in zip(*formal, strict=True)]
        for formal in zip(ctx.args, ctx.arg_types, strict=True)
    ]
    solved = _solve(ctx, signature, actuals)
    conflicts = [
        var
        for var in _column_vars(signature)
        if var.id not in solved and _sources(signature, actuals, var)
    ]
    for var in conflicts:
        sets = ", ".join(
            f"{format_type(found, ctx.api.options)} ({argument})"
            for argument, found in _sources(signature, actuals, var)
        )
        ctx.api.fail(
            f'Column sets differ in a call to "{name}": {sets}; the records and columns'
            " of one call carry one column set",
            ctx.context,
            code=ARG_TYPE,
        )
    if conflicts or not solved:
        return ctx.default_return_type
    if any(var.id not in solved for var in get_all_type_vars(signature.ret_type)):
        return ctx.default_return_type  # a variable the arguments leave open, or not a set
    return expand_type(signature.ret_type, solved)


def _column_vars(signature: CallableType) -> list[TypeVarType]:
    # The signature's type variables bound by Columns.
    return [
        var
        for var in signature.variables
        if isinstance(var, TypeVarType)
        and isinstance(bound := get_proper_type(var.upper_bound), Instance)
        and bound.type.fullname == _COLUMNS
    ]


def _from_items(ctx: FunctionContext, expression: Expression, given: Type) -> Type:
    # A list, set or tuple display takes its item types from the call's context too
    # (`[chunk]` where `Sequence[Req | Chunked[Any]]` goes is a `list[Req | Chunked[Any]]`):
    # its items' own types say what it holds.
    if not isinstance(expression, ListExpr | SetExpr | TupleExpr) or not expression.items:
        return given
    items = []
    for item in expression.items:
        if isinstance(item, StarExpr):
            iterable = get_proper_type(ctx.api.get_expression_type(item.expr))
            if not isinstance(iterable, Instance) or len(iterable.args) != 1:
                return given
            items.append(iterable.args[0])
        else:
            items.append(ctx.api.get_expression_type(item))
    if isinstance(expression, TupleExpr):
        if any(isinstance(item, StarExpr) for item in expression.items):
            return given
        fallback = ctx.api.named_generic_type("builtins.tuple", [make_simplified_union(items)])
        return TupleType(items, fallback)
    kind = "builtins.list" if isinstance(expression, ListExpr) else "builtins.set"
    return ctx.api.named_generic_type(kind, [make_simplified_union(items)])


def _solve(
    ctx: FunctionContext, signature: CallableType, actuals: list[list[Type]]
) -> dict[TypeVarId, Type]:
    # The column sets mypy infers from the arguments alone; a set that is `Any`, empty or
    # left unsolved is left out.
    types: list[Type | None] = []
    kinds: list[ArgKind] = []
    names: list[str | None] = []
    formal_to_actual: list[list[int]] = []
    for formal_types, formal_kinds, formal_names in zip(
        actuals, ctx.arg_kinds, ctx.arg_names, strict=True
    ):
        formal_to_actual.append(list(range(len(types), len(types) + len(formal_types))))
        types.extend(formal_types)
        kinds.extend(formal_kinds)
        names.extend(formal_names)
    anything = AnyType(TypeOfAny.special_form)
    context = ArgumentInferContext(
        ctx.api.named_generic_type("typing.Mapping", [anything, anything]),
        ctx.api.named_generic_type("typing.Iterable", [anything]),
    )
    inferred, _ = infer_function_type_arguments(
        signature, types, kinds, names, formal_to_actual, context
    )
    columns = {var.id for var in _column_vars(signature)}
    return {
        var.id: found
        for var, found in zip(signature.variables, inferred, strict=True)
        if var.id in columns and found is not None and _definite(found)
    }


def _sources(
    signature: CallableType, actuals: list[list[Type]], var: TypeVarType
) -> list[tuple[str, Type]]:
    # Each argument that fixes `var` on its own, with the set it fixes (one entry per set).
    found: list[tuple[str, Type]] = []
    for formal, name, formal_actuals in zip(
        signature.arg_types, signature.arg_names, actuals, strict=True
    ):
        for actual in formal_actuals:
            (solution,) = infer_type_arguments([var], formal, actual, is_supertype=True)
            if solution is None or not _definite(solution):
                continue
            if not any(is_same_type(solution, seen) for _, seen in found):
                found.append((name or "argument", solution))
    return found if len(found) > 1 else []


def _definite(found: Type) -> bool:
    # A column set mypy knows: not Any, not Never (an empty list's items).
    return not isinstance(get_proper_type(found), AnyType | UninhabitedType)
