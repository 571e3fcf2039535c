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


# The package's floors, lowest first: a module imports from its own floor and those below,
# never from one above (not even inside a function). Each entry is a folder or a module of
# reasoner/, so a new one must be given its floor here.
FLOORS = (("errors", "credentials", "install"), ("config",), ("chips", "mesh"),
          ("models", "data"),
          ("rewards", "datareport"), ("engine", "report"), ("objectives",), ("build",),
          ("evaluation", "planner"), ("loop", "export"), ("notebook", "cli", "__main__"))


def _floor(module: str) -> int:
  part = module.split(".")[1]
  return next(k for k, names in enumerate(FLOORS) if part in names)


def _climbing(graph: dict[str, dict[str, int]]) -> list[str]:
  """'a (floor i) imports b (floor j > i) at line n' for each import that climbs."""
  return [f"{a} (floor {_floor(a)}) imports {b} (floor {_floor(b)}) at line {line}"
          for a, targets in sorted(graph.items()) for b, line in sorted(targets.items())
          if b != "reasoner" and a != "reasoner" and _floor(b) > _floor(a)]


def test_every_part_of_the_package_has_a_floor():
  parts = {p.stem for p in ROOT.iterdir()
           if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
  named = {n for names in FLOORS for n in names}
  assert parts == named, f"without a floor: {sorted(parts - named)}; gone: {sorted(named - parts)}"


def test_no_import_climbs_a_floor():
  graph, _ = _graph()
  climbing = _climbing(graph)
  assert not climbing, "\n".join(climbing)


def test_the_floor_check_finds_a_climbing_import():
  """The tree's graph with one import added that climbs (the config imports the loop, as
  config/loop.py once imported engine/session.py) is caught, naming both floors."""
  graph, _ = _graph()
  graph["reasoner.config.loop"] = {**graph["reasoner.config.loop"], "reasoner.engine.session": 9}
  assert _climbing(graph) == ["reasoner.config.loop (floor 1) imports reasoner.engine.session "
                              "(floor 5) at line 9"]


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
