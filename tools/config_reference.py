"""docs/configuration.md, generated from the config Structs of ``zserve/config.py``: each table's docstring, and
each key's type, default and attribute docstring (the string literal under the field). One source of truth, as
``/openapi.json`` is generated from the API types.

    python -m tools.config_reference docs/configuration.md   # rewrite the page
    python -m tools.config_reference                         # print it
    python -m tools.config_reference --engine-options docs/generation.md  # its "Engine options" table, from
                                                                           # zserve/generator/options.py

``tests/docs/test_config_reference.py`` fails when the page is stale, and so does this module when a key has no
description.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
import textwrap
from pathlib import Path

import msgspec
import msgspec.inspect as mi

from zserve.config import Config

COMMAND = "python -m tools.config_reference docs/configuration.md"

_INTRO = f"""\
# Configuration reference

<!-- Generated from zserve/config.py by `{COMMAND}`: edit the docstrings there, not this page. -->

`supervisor.toml` is a deployment's one configuration file: `zserve up`, `zserve supervisord-conf`, `zserve k8s`,
`zserve status` and `zserve.Client.from_config` all read it. It is decoded into typed msgspec Structs: unknown keys
and bad values are refused at start with the key's name and exit code 2
(`zserve: supervisor.toml: models[0].max_batch_size: Expected int >= 1`); `zserve check -c FILE` checks a file
without starting anything. A key left out takes the default below; `zserve serve MODEL --print-config` writes a
complete file to start from.

The handlers' own options (`[models.options]`) are described with each handler: [models and
tasks](models-and-tasks.md), [generation](generation.md#engine-options),
[embeddings](embeddings.md#options-modelsoptions).
A worker host's `workers.toml` (`zserve workers`) is in [operations](operations.md#several-hosts).
"""


class MissingDescription(ValueError):
    """A config key has no docstring: the page would leave it unexplained."""


def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal right under it), as one paragraph."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _unwrap(t: mi.Type) -> mi.Type:
    return t.type if isinstance(t, mi.Metadata) else t


def _number(value: float) -> str:
    """A bound as a person writes it: 0, not 0.0. Also the one spelling whatever the import order: typing caches
    ``Annotated[float, Meta(gt=0)]`` and ``Meta(gt=0.0)`` as one type (0 == 0.0), so a module may see the other's."""
    return str(int(value)) if float(value).is_integer() else str(value)


def _bounds(t: mi.IntType | mi.FloatType) -> str:
    ops = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
    return ", ".join(f"{op} {_number(getattr(t, name))}" for name, op in ops if getattr(t, name) is not None)


def type_name(t: mi.Type) -> str:
    """A field's type as TOML spells it, with its bounds."""
    t = _unwrap(t)
    if isinstance(t, mi.UnionType):
        kinds = [type_name(x) for x in t.types if not isinstance(x, mi.NoneType)]
        return " or ".join(kinds) + (" (or unset)" if len(kinds) < len(t.types) else "")
    if isinstance(t, mi.LiteralType):
        return " or ".join(f"`{json.dumps(v)}`" for v in t.values)
    if isinstance(t, (mi.IntType, mi.FloatType)):
        base = "integer" if isinstance(t, mi.IntType) else "float"
        bounds = _bounds(t)
        return f"{base} {bounds}" if bounds else base
    names = {mi.StrType: "string", mi.BoolType: "boolean", mi.DictType: "table"}
    for kind, name in names.items():
        if isinstance(t, kind):
            return name
    if isinstance(t, mi.ListType):
        return f"array of {type_name(t.item_type)}s"
    raise TypeError(f"no TOML name for {t!r}")


def default_text(field: mi.Field) -> str:
    if field.required:
        return "required"
    value = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    if value is None:
        return "unset"
    return f"`{json.dumps(msgspec.to_builtins(value))}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table_intro(struct: type) -> str:
    """The Struct's docstring as markdown, without its leading "``[name]``: " (the heading says it)."""
    text = " ".join(inspect.cleandoc(struct.__doc__ or "").split()).replace("``", "`")
    text = re.sub(r"^`\[+\w+\]+`: ", "", text)
    return text[:1].upper() + text[1:]


def table(struct: type, heading: str) -> str:
    return "\n".join([f"## `{heading}`", "", table_intro(struct), "", *rows(struct)]) + "\n"


def rows(struct: type, first: str = "key") -> list[str]:
    """The Struct's fields as a markdown table: name, type with bounds, default, docstring."""
    info = mi.type_info(struct)
    assert isinstance(info, mi.StructType)
    docs = field_docs(struct)
    missing = [f.name for f in info.fields if f.name not in docs]
    if missing:
        raise MissingDescription(
            f"{struct.__name__}: {', '.join(missing)} need a docstring (a string literal under the field)"
        )
    lines = [f"| {first} | type | default | meaning |", "|---|---|---|---|"]
    for f in info.fields:
        lines.append(f"| `{f.name}` | {_cell(type_name(f.type))} | {_cell(default_text(f))} | {_cell(docs[f.name])} |")
    return lines


ENGINE_COMMAND = "python -m tools.config_reference --engine-options docs/generation.md"
ENGINE_HEADING = "## Engine options\n"


def engine_options(page: str) -> str:
    """``page`` (docs/generation.md) with its "Engine options" section generated from ``GeneratorOptions``."""
    from zserve.generator.options import GeneratorOptions

    start = page.index(ENGINE_HEADING) + len(ENGINE_HEADING)
    end = page.find("\n## ", start)
    end = len(page) if end < 0 else end + 1
    section = [
        "",
        f"<!-- Generated from zserve/generator/options.py by `{ENGINE_COMMAND}`: edit the docstrings there. -->",
        "",
        table_intro(GeneratorOptions),
        "",
        *rows(GeneratorOptions, first="option"),
        "",
        "",
    ]
    return page[:start] + "\n".join(section) + page[end:]


def render(config: type = Config) -> str:
    """The whole page: one section per table of ``config``, in the order the Struct declares them."""
    info = mi.type_info(config)
    assert isinstance(info, mi.StructType)
    sections = [_INTRO]
    for f in info.fields:
        t = _unwrap(f.type)
        if isinstance(t, mi.StructType):
            sections.append(table(t.cls, f"[{f.name}]"))
        elif isinstance(t, mi.ListType) and isinstance(_unwrap(t.item_type), mi.StructType):
            sections.append(table(_unwrap(t.item_type).cls, f"[[{f.name}]]"))  # type: ignore[union-attr]
        else:
            raise TypeError(f"{config.__name__}.{f.name}: a top-level key must be a table or an array of tables")
    return "\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--engine-options"]:
        page = Path(args[1] if len(args) > 1 else "docs/generation.md")
        page.write_text(engine_options(page.read_text()))
        return 0
    text = render()
    if not args:
        sys.stdout.write(text)
        return 0
    Path(args[0]).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
