"""Typed dataclasses from YAML mappings: every key checked against the fields, every value
against its type hint (Literal, Union, tuple, nested dataclasses), with errors that name the
dotted key; and the 'a.b.c=value' overrides of the command line."""

from __future__ import annotations

import dataclasses
import datetime
import re
import types
import typing
from typing import Any, Literal

import yaml

from reasoner.errors import ConfigError


def fail(key: str, value: Any, expected: str) -> None:
  raise ConfigError(f"config key '{key}' = {value!r}: expected {expected}")


class _Loader(yaml.SafeLoader):
  """YAML 1.1 reads '1e-5' and '3E-4' as strings (its floats need a dot and a signed exponent);
  here every form Python reads as a float is one."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def parse_yaml(text: str) -> Any:
  return yaml.load(text, Loader=_Loader)


def build(cls: type, data: Any, key: str) -> Any:
  """Builds dataclass `cls` from a mapping, checking every key and type."""
  if data is None:
    data = {}
  if not isinstance(data, dict):
    fail(key or "<root>", data, f"a mapping of {cls.__name__} fields")
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - fields)
  if unknown:
    where = f"'{key}'" if key else "the top level"
    raise ConfigError(f"unknown config key '{_join(key, unknown[0])}'; known keys in {where}: "
                      f"{', '.join(sorted(fields))}")
  kwargs = {name: _coerce(hints[name], value, _join(key, name)) for name, value in data.items()}
  return cls(**kwargs)


def _join(prefix: str, name: str) -> str:
  return f"{prefix}.{name}" if prefix else name


def _coerce(tp: Any, value: Any, key: str) -> Any:
  origin = typing.get_origin(tp)
  args = typing.get_args(tp)
  if dataclasses.is_dataclass(tp):
    return build(tp, value, key)
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1 and value is not None:  # X | None: X's own message, naming the key
      return _coerce(options[0], value, key)
    errors = []
    for a in options:
      try:
        return _coerce(a, value, key)
      except ConfigError as e:
        errors.append(str(e))
    fail(key, value, " or ".join(_describe(a) for a in args))
  if origin is Literal:
    if value not in args:
      fail(key, value, "one of " + ", ".join(repr(a) for a in args))
    return value
  if origin is tuple:
    if not isinstance(value, (list, tuple)):
      fail(key, value, "a list")
    return tuple(_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
  if tp is bool:
    if not isinstance(value, bool):
      fail(key, value, "true or false")
    return value
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      fail(key, value, "an integer")
    return value
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      fail(key, value, "a number")
    return float(value)
  if tp is str:
    if isinstance(value, (datetime.date, datetime.datetime)):  # YAML reads ISO times itself
      return value.isoformat()
    if not isinstance(value, str):
      fail(key, value, "a string")
    return value
  raise TypeError(f"unsupported config type {tp} for {key}")


def _describe(tp: Any) -> str:
  if tp is type(None):
    return "null"
  if typing.get_origin(tp) is Literal:
    return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
  return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
      tp, getattr(tp, "__name__", str(tp)))


def apply_override(tree: dict[str, Any], override: str) -> None:
  """Sets 'a.b.c=value' in a nested dict; the value is parsed as YAML ('5', 'true', 'null')."""
  if "=" not in override:
    raise ConfigError(f"override {override!r}: expected key=value, e.g. train.steps=5")
  dotted, raw = override.split("=", 1)
  parts = dotted.strip().split(".")
  if not all(parts):
    raise ConfigError(f"override {override!r}: the key {dotted!r} has an empty part")
  node = tree
  for i, part in enumerate(parts[:-1]):
    child = node.setdefault(part, {})
    if not isinstance(child, dict):
      raise ConfigError(f"override {override!r}: '{'.'.join(parts[:i + 1])}' is not a section")
    node = child
  try:
    node[parts[-1]] = parse_yaml(raw)
  except yaml.YAMLError as e:
    raise ConfigError(f"override {override!r}: the value is not valid YAML ({e})") from None
