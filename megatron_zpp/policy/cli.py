"""Generate argparse flags from a config dataclass: one flag per field, its docstring as help.

Megatron-Core's configs document each field with an attribute docstring; so do ours,
and the CLI is derived from them so the two never drift apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal right below each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _scalar_type(annotation) -> type:
    """``int | None`` -> int; ``str`` -> str."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def flag_name(prefix: str, field: str) -> str:
    return f"--{prefix}-{field.replace('_', '-')}"


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, prefix: str, title: str) -> None:
    """Add ``--{prefix}-{field}`` for every field of ``cls`` (dest ``{prefix}_{field}``)."""
    group = parser.add_argument_group(title=title)
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = _scalar_type(hints[f.name])
        dest = f"{prefix}_{f.name}".replace("-", "_")
        help_text = docs.get(f.name, "").replace("%", "%%")  # argparse formats help strings with %
        if kind is bool:
            group.add_argument(flag_name(prefix, f.name), dest=dest, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_text)
        else:
            suffix = "" if f.default is None else f" (default: {f.default})"
            group.add_argument(flag_name(prefix, f.name), dest=dest, type=kind, default=f.default,
                               help=help_text + suffix)


def dataclass_from_args(cls: type, args: argparse.Namespace, prefix: str):
    values = {f.name: getattr(args, f"{prefix}_{f.name}") for f in dataclasses.fields(cls)
              if hasattr(args, f"{prefix}_{f.name}")}
    return cls(**values)
