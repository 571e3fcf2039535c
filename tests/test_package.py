"""The package's shape: imports run downhill (no module imports one that imports it back, not
even inside a function), files read on a screen or two, functions on one."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "reasoner"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for p in sorted(ROOT.rglob("*.py")):
    parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    out[".".join(parts)] = p
  return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> dict[str, int]:
  """{module of this package it imports: line}, at any depth of the file (inside functions and
  `if TYPE_CHECKING:` too); `from pkg import mod` counts as mod where mod is a module."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out = {}
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                        + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                 for a in node.names]
    else:
      continue
    for t in targets:
      while t and t not in known:  # a name inside a module: the module
        t = t.rpartition(".")[0]
      if t and t != name:
        out.setdefault(t, node.lineno)
  return out


def _graph() -> tuple[dict[str, dict[str, int]], dict[str, pathlib.Path]]:
  mods = _modules()
  return {m: _imports(m, p, set(mods)) for m, p in mods.items()}, mods


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
  state: dict[str, int] = {}  # 1 on the stack, 2 done
  stack: list[str] = []

  def visit(m: str) -> list[str] | None:
    state[m] = 1
    stack.append(m)
    for n in sorted(graph.get(m, {})):
      if state.get(n) == 1:
        return stack[stack.index(n):] + [n]
      if n not in state and (found := visit(n)):
        return found
    stack.pop()
    state[m] = 2
    return None

  for m in sorted(graph):
    if m not in state and (found := visit(m)):
      return found
  return None


def test_the_import_graph_is_acyclic():
  graph, _ = _graph()
  assert "reasoner.engine.sampler" in graph and "reasoner.planner.plan" in graph
  cycle = _cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
  assert _cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1}}) is None


def test_imports_inside_functions_only_keep_jax_out_of_a_bad_configs_path():
  """A function-level import of a reasoner module is allowed only in the entry points (the CLI
  and the notebook's cells), which load jax after the config is valid."""
  allowed = {"reasoner.cli", "reasoner.notebook"}
  found = []
  for name, path in _modules().items():
    for fn in ast.walk(ast.parse(path.read_text())):
      if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      for node in ast.walk(fn):
        mod = (node.module or "" if isinstance(node, ast.ImportFrom) else
               " ".join(a.name for a in node.names) if isinstance(node, ast.Import) else None)
        if mod and mod.startswith("reasoner") and name not in allowed:
          found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {mod}")
  assert not found, "\n".join(found)


def test_the_config_path_imports_no_jax():
  """A bad config fails before jax loads: the CLI and the config package import none of it."""
  code = ("import sys, reasoner.cli, reasoner.config, reasoner.notebook; "
          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_files_and_functions_read_on_a_screen(path: pathlib.Path):
  text = path.read_text()
  assert len(text.splitlines()) <= MAX_FILE_LINES
  long = [f"{fn.name} ({fn.end_lineno - fn.lineno + 1} lines, line {fn.lineno})"
          for fn in ast.walk(ast.parse(text))
          if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
          and fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES]
  assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"
