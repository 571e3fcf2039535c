"""The configuration reference, generated from the typed config itself: every key with its type,
its default and the comment written beside it in `reasoner/config/` (the only place they are
written), so the reference cannot drift. `python -m reasoner config --docs` writes it to
docs/configuration.md; a test fails when the committed file differs.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import textwrap
import tokenize
import types
import typing
from typing import Any, Literal

HEADER = """# Configuration reference

Generated from `reasoner/config/` by `python -m reasoner config --docs` (`make docs`); do not edit
by hand: a test fails when this file differs from what the command writes. A preset is YAML
with these sections; any key can be overridden on the command line (`train.steps=5`), and
`python -m reasoner config --config FILE [key=value ...]` prints a preset as resolved.
"""


def describe_type(tp: Any) -> str:
  """A type hint as a reader writes it in YAML: `'a' | 'b'`, `int | null`, `list of str`."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if tp is type(None):
    return "null"
  if origin in (typing.Union, types.UnionType):
    return " | ".join(describe_type(a) for a in args)
  if origin is Literal:
    return " | ".join(repr(a) for a in args)
  if origin is tuple:
    return f"list of {describe_type(args[0])}"
  if dataclasses.is_dataclass(tp):
    return "mapping"
  return getattr(tp, "__name__", str(tp))


def _comments(cls: type) -> dict[str, str]:
  """{field: its comment}: the comment lines right above a field and the comment at its end,
  where the field is written (a base dataclass's fields in the base)."""
  out = {}
  for base in reversed(cls.__mro__):
    if dataclasses.is_dataclass(base):
      out.update(_own_comments(base))
  return out


def _own_comments(cls: type) -> dict[str, str]:
  source = textwrap.dedent(inspect.getsource(cls))
  notes = {tok.start[0]: tok.string.lstrip("#").strip()
           for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT}
  lines = source.splitlines()
  out = {}
  for node in ast.parse(source).body[0].body:
    if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
      continue
    above, k = [], node.lineno - 1
    while k >= 1 and lines[k - 1].strip().startswith("#"):
      above.insert(0, notes[k])
      k -= 1
    beside = [notes[k] for k in range(node.lineno, node.end_lineno + 1) if k in notes]
    out[node.target.id] = " ".join(above + beside)
  return out


def _default(f: dataclasses.Field) -> str:
  if f.default is not dataclasses.MISSING:
    value = f.default
  elif f.default_factory is not dataclasses.MISSING:
    value = f.default_factory()
  else:
    return "(required)"
  if dataclasses.is_dataclass(value):
    return "(section)"
  if isinstance(value, tuple):
    value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
  return json.dumps(value).replace("|", "\\|")


def _element(tp: Any) -> type | None:
  """The dataclass a field holds (itself, in a list, or optional), if any."""
  for a in (tp, *typing.get_args(tp)):
    if dataclasses.is_dataclass(a):
      return a
    if typing.get_origin(a) is tuple and dataclasses.is_dataclass(typing.get_args(a)[0]):
      return typing.get_args(a)[0]
  return None


def sections(cls: type, prefix: str = "") -> list[tuple[str, type]]:
  """(key, dataclass) of every section under `cls`, depth first; list items as `key[]`."""
  out = []
  for f in dataclasses.fields(cls):
    tp = typing.get_type_hints(cls)[f.name]
    inner = _element(tp)
    if inner is not None:
      listed = any(typing.get_origin(a) is tuple for a in (tp, *typing.get_args(tp)))
      key = f"{prefix}{f.name}{'[]' if listed else ''}"
      out += [(key, inner), *sections(inner, key + ".")]
  return out


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def markdown(root: type) -> str:
  """The reference of `root` (the `Config` class): a table per section."""
  parts = [HEADER]
  for key, cls in sections(root):
    doc = inspect.cleandoc(cls.__doc__ or "")
    hints, notes = typing.get_type_hints(cls), _comments(cls)
    rows = [f"| `{f.name}` | {_cell(describe_type(hints[f.name]))} | `{_default(f)}` | "
            f"{_cell(notes.get(f.name, ''))} |" for f in dataclasses.fields(cls)]
    parts.append(f"## `{key}`\n\n{doc}\n\n| key | type | default | meaning |\n|---|---|---|---|\n"
                 + "\n".join(rows) + "\n")
  return "\n".join(parts)
