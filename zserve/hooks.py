"""Start-up checks of a model's hooks, so that a misplaced resource fails at ``zserve up``, not at the first
request. ``setup`` runs only in engines and ``setup_preprocess`` only in preprocess stages: a ``preprocess``
that reads ``self.tokenizer`` created in ``setup`` would fail in every stage process."""

from __future__ import annotations

import ast
import inspect
import textwrap

from zserve.model import Model, uses_preprocess


class HookError(ValueError):
    """A model's hooks are wired so that they cannot work; the message says how to fix it."""


def _method_ast(cls: type, name: str) -> ast.FunctionDef | None:
    for klass in cls.__mro__:
        if klass is object or name not in vars(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(vars(klass)[name]))
        except (OSError, TypeError):
            return None  # no source (built in C, or defined at a prompt): nothing to check
        tree = ast.parse(source)
        node = tree.body[0] if tree.body else None
        return node if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None
    return None


def _self_attributes(fn: ast.FunctionDef | None, ctx: type[ast.expr_context]) -> set[str]:
    """Names X of ``self.X`` that ``fn`` reads (``ast.Load``) or assigns (``ast.Store``)."""
    if fn is None or not fn.args.args:
        return set()
    me = fn.args.args[0].arg
    return {
        node.attr
        for node in ast.walk(fn)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ctx)
        and isinstance(node.value, ast.Name)
        and node.value.id == me
    }


def _assigned_anywhere(cls: type, method: str) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object or method not in vars(klass):
            continue
        names |= _self_attributes(_method_ast(klass, method), ast.Store)
    return names


def check_preprocess_hooks(cls: type[Model]) -> None:
    """Raise HookError if ``preprocess`` reads an attribute that only ``setup`` (an engine-only hook)
    creates."""
    if not uses_preprocess(cls):
        return
    read = _self_attributes(_method_ast(cls, "preprocess"), ast.Load)
    available = _assigned_anywhere(cls, "__init__") | _assigned_anywhere(cls, "setup_preprocess")
    only_in_setup = _assigned_anywhere(cls, "setup") - available
    for name in sorted(read & only_in_setup):
        if hasattr(cls, name):
            continue  # a class attribute or method of the same name is there in every process
        raise HookError(
            f"{cls.__module__}.{cls.__qualname__}.preprocess uses self.{name}, which only setup() creates; "
            f"setup() runs in engine processes only, so every preprocess stage would fail. "
            f"Move it to setup_preprocess() (or create it in both)."
        )
