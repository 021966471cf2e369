"""The codec registry and its strict spec-string parser.

A spec is ``name`` or ``name:key=value,key=value``. Each codec registers a
frozen config dataclass whose fields (with docstrings in the source) are its
parameters; the parser converts values by the field types and rejects anything
unknown, listing what is valid. This module is the one place a codec is added.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Callable, Literal, get_args, get_origin

from megatron_zpp.compression.base import Codec

_REGISTRY: dict[str, tuple[type, Callable[[object], Codec]]] = {}


def register_codec(name: str, config_cls: type, factory: Callable[[object], Codec]) -> None:
    """Register ``name``; ``factory(config_cls(**params))`` builds the codec."""
    if name in _REGISTRY:
        raise ValueError(f"codec {name!r} is already registered")
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"config_cls for codec {name!r} must be a dataclass")
    _REGISTRY[name] = (config_cls, factory)


def available_codecs() -> list[str]:
    return sorted(_REGISTRY)


def _convert(codec: str, key: str, raw: str, annotation) -> object:
    if get_origin(annotation) is Literal:
        choices = get_args(annotation)
        if raw not in choices:
            raise ValueError(f"codec {codec!r}: {key}={raw!r} is not valid; valid: {', '.join(choices)}")
        return raw
    if annotation is int:
        try:
            return int(raw, 10)
        except ValueError:
            raise ValueError(f"codec {codec!r}: {key}={raw!r} is not an integer") from None
    if annotation is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"codec {codec!r}: {key}={raw!r} is not a number") from None
    if annotation is bool:
        if raw.lower() in ("1", "true", "yes"):
            return True
        if raw.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"codec {codec!r}: {key}={raw!r} is not a boolean (true/false)")
    return raw


def parse_spec(spec: str) -> tuple[str, object]:
    """Parse ``spec`` into ``(codec name, config instance)``; ``ValueError`` on anything unknown."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"codec spec must be a non-empty string like 'int8:block=256', got {spec!r}; "
                         f"valid codecs: {', '.join(available_codecs())}")
    name, _, params = spec.strip().partition(":")
    name = name.strip()
    if name not in _REGISTRY:
        raise ValueError(f"unknown codec {name!r} in spec {spec!r}; valid codecs: {', '.join(available_codecs())}")
    config_cls, _ = _REGISTRY[name]
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    hints = typing.get_type_hints(config_cls)
    values: dict[str, object] = {}
    if params.strip():
        for item in params.split(","):
            key, eq, raw = item.partition("=")
            key, raw = key.strip(), raw.strip()
            if not eq or not key or not raw:
                raise ValueError(f"malformed parameter {item!r} in spec {spec!r}; expected key=value")
            if key not in fields:
                valid = ", ".join(fields) or "(none)"
                raise ValueError(f"unknown parameter {key!r} for codec {name!r} in spec {spec!r}; valid: {valid}")
            if key in values:
                raise ValueError(f"parameter {key!r} given twice in spec {spec!r}")
            values[key] = _convert(name, key, raw, hints[key])
    return name, config_cls(**values)


def canonical_spec(name: str, config: object) -> str:
    """``name:k=v,...`` listing every parameter, so equal codecs have equal specs; a parameter added after specs
    were first written down (``metadata={"spec_omit_default": True}``) is listed only when it is not its default,
    so the specs of codecs without it stay the same strings (in logs, checkpoints, sweep results)."""
    items = [f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
             if not (f.metadata.get("spec_omit_default") and getattr(config, f.name) == f.default)]
    return f"{name}:{','.join(items)}" if items else name


def get_codec(spec: str) -> Codec:
    """Build a codec from a spec string, e.g. ``"int8:block=256"``, ``"int4:block=128,rounding=stochastic"``.

    Returns a new instance each call (stochastic codecs carry a call counter).
    """
    if isinstance(spec, Codec):
        return spec
    name, config = parse_spec(spec)
    return _REGISTRY[name][1](config)
