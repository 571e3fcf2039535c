"""FLOPs and HBM traffic of a compiled XLA program, read from its HLO text.

XLA's cost analysis counts a while loop's body once, so a `lax.scan` of K steps (the chunked
head) or the sampler's decode loop would count as one step. `hlo_cost` walks every computation
instead: matmul and convolution FLOPs, loop bodies multiplied by their trip count (XLA's
`known_trip_count`, else the loop condition's bound), and bytes moved (operands + results of
each unfused op or fusion, slices counted at their size).
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

_ARRAY = re.compile(r"\b(pred|bf16|[suf]\d+|f8\w*|c64|c128)\[([\d,]*)\]")
_ITEM = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all",
         "partition-id", "replica-id", "iota"}


@dataclasses.dataclass
class _Op:  # one HLO instruction: `name = shape op(text_args), attrs`
  name: str
  shape: str
  op: str
  args: list[str]  # operand names
  attrs: str
  text_args: str


def _dims(shape: str) -> list[int]:
  m = _ARRAY.search(shape)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def _nbytes(shape: str) -> float:
  size = lambda dt: _ITEM.get(dt) or max(1, int(re.sub(r"\D", "", dt.split("e")[0])) // 8)
  return sum(math.prod(int(d) for d in dims.split(",") if d) * size(dt)
             for dt, dims in _ARRAY.findall(shape))


def _close(s: str, i: int) -> int:
  """Index of the parenthesis closing the one at s[i]."""
  depth = 0
  for j in range(i, len(s)):
    depth += {"(": 1, ")": -1}.get(s[j], 0)
    if depth == 0:
      return j
  return len(s) - 1


def _parse_op(line: str) -> _Op | None:
  m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)", line)
  if not m:
    return None
  name, rest = m.groups()
  if rest.startswith("("):
    j = _close(rest, 0)
    shape, rest = rest[:j + 1], rest[j + 2:]
  else:
    shape, _, rest = rest.partition(" ")
  k = rest.find("(")
  if k < 0:
    return None
  j = _close(rest, k)
  text_args = rest[k + 1:j]
  return _Op(name, shape, rest[:k], re.findall(r"%([\w.\-]+)", text_args), rest[j + 1:],
             text_args)


def parse_hlo(text: str) -> tuple[dict[str, dict[str, _Op]], str]:
  """Computations of an HLO module's text: {name: {op name: op}}, and the entry's name."""
  comps: dict[str, dict[str, _Op]] = {}
  entry, current = "", None
  for line in text.splitlines():
    head = re.match(r"(ENTRY\s+)?%?([\w.\-]+) .*\{\s*$", line)
    if head and not line.startswith(" "):
      current = comps.setdefault(head.group(2), {})
      entry = head.group(2) if head.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None and (op := _parse_op(line)):
      current[op.name] = op
  return comps, entry


def _called(op: _Op, key: str) -> list[str]:
  m = re.search(r"\b" + key + r"=(\{[^}]*\}|%?[\w.\-]+)", op.attrs)
  return re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []


def _index(op: _Op) -> int:
  m = re.search(r"index=(\d+)", op.attrs)
  return int(m.group(1)) if m else -1


def _induction(op: _Op, comp: dict[str, _Op], comps: dict) -> int | None:
  """Trips of `while i < N` from its condition, the body's `i + step` and the initial i."""
  cond = comps.get((_called(op, "condition") or [""])[0], {})
  body = list(comps.get((_called(op, "body") or [""])[0], {}).values())
  for c in cond.values():
    if c.op != "compare" or "direction=LT" not in c.attrs or len(c.args) != 2:
      continue
    i, n = cond.get(c.args[0]), cond.get(c.args[1])
    if not (i and n and i.op == "get-tuple-element" and n.op == "constant"):
      continue
    k, step, init = _index(i), 1, 0
    body_ops = {b.name: b for b in body}
    nxt = body_ops.get(body[-1].args[k]) if body and body[-1].op == "tuple" else None
    if nxt is not None and nxt.op == "add":
      consts = [body_ops[a] for a in nxt.args if a in body_ops and body_ops[a].op == "constant"]
      step = int(consts[0].text_args) if consts else 1
    start = comp.get(op.args[0]) if op.args else None
    if start is not None and start.op == "tuple" and k < len(start.args):
      first = comp.get(start.args[k])
      init = int(first.text_args) if first is not None and first.op == "constant" else 0
    return max(0, -(-(int(n.text_args) - init) // max(1, step)))
  return None


def _trip_count(op: _Op, comp: dict[str, _Op], comps: dict) -> int:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', op.attrs)
  if m:
    return int(m.group(1))
  trips = _induction(op, comp, comps)
  if trips is not None:
    return trips
  consts, todo = [1], _called(op, "condition")  # else the condition's largest integer
  while todo:  # constant (i < n), in the fusions it calls too
    for c in comps.get(todo.pop(), {}).values():
      consts += [int(c.text_args)] if c.op == "constant" and re.match(r"[su]\d+\[\]",
                                                                        c.shape) else []
      todo += _called(c, "calls")
  return max(consts)


def _window(op: _Op, key: str, n: int, default: int) -> list[int]:
  m = re.search(r"\b" + key + r"=([\d_x]+)", op.attrs)
  return [int(v.split("_")[0]) for v in m.group(1).split("x")] if m else [default] * n


def _matmul_flops(op: _Op, comp: dict[str, _Op]) -> float:
  """2 x multiply-adds of a dot or convolution. For a convolution only the (output, window)
  pairs that land on real input count, as in XLA's HloCostAnalysis: gradients lowered to
  convolutions carry wide zero padding."""
  out = _dims(op.shape)
  if op.op == "dot":
    lhs = _dims(comp[op.args[0]].shape) if op.args[0] in comp else []
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", op.attrs)
    k = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i) if m and lhs else 1
    return 2.0 * math.prod(out) * k
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", op.attrs)
  lhs, rhs = (_dims(comp[a].shape) if a in comp else [] for a in op.args[:2])
  if not labels or not lhs or not rhs:
    return 0.0
  ll, rl, ol = labels.groups()
  n = len(ll) - 2
  lo = _window(op, "pad", n, 0)
  stride, ldil, rdil = (_window(op, k, n, 1) for k in ("stride", "lhs_dilate", "rhs_dilate"))
  total = 2.0 * out[ol.index("b")] * out[ol.index("f")] * rhs[rl.index("i")]
  for d in range(n):
    size, c = lhs[ll.index(str(d))], str(d)
    pos = (np.arange(out[ol.index(c)])[:, None] * stride[d]
           + np.arange(rhs[rl.index(c)])[None] * rdil[d] - lo[d])
    total *= int(np.sum((pos >= 0) & (pos <= (size - 1) * ldil[d]) & (pos % ldil[d] == 0)))
  return total


def _fusion_bytes(op: _Op, comp: dict[str, _Op], fused: dict[str, _Op]) -> float:
  """Operands + result of one fusion; operands only sliced inside count at the slice's size,
  a buffer updated in place (dynamic-update-slice) at the update's size."""
  users: dict[str, list[_Op]] = {}
  for f in fused.values():
    for a in f.args:
      users.setdefault(a, []).append(f)
  params = {int(f.text_args): f.name for f in fused.values() if f.op == "parameter"}
  total = 0.0
  root = list(fused.values())[-1] if fused else None
  for i, a in enumerate(op.args):
    us = users.get(params.get(i, ""), [])
    if us and all(u.op in ("dynamic-slice", "slice", "gather") for u in us):
      total += sum(_nbytes(u.shape) for u in us)
    elif us and all(u.op == "dynamic-update-slice" and u.args[0] == params[i] for u in us):
      continue
    else:
      total += _nbytes(comp[a].shape) if a in comp else 0.0
  if root is not None and root.op == "dynamic-update-slice" and root.args[1] in fused:
    return total + _nbytes(fused[root.args[1]].shape)
  return total + _nbytes(op.shape)


def hlo_cost(text: str) -> tuple[float, float]:
  """(FLOPs, HBM bytes) of a compiled HLO module, every loop body counted once per trip."""
  comps, entry = parse_hlo(text)
  memo: dict[tuple[str, bool], float] = {}

  def walk(name: str, traffic: bool) -> float:
    if (name, traffic) in memo:
      return memo[(name, traffic)]
    comp, total = comps.get(name, {}), 0.0
    for op in comp.values():
      if op.op == "while":
        trips = _trip_count(op, comp, comps)
        total += trips * sum(walk(c, traffic) for c in _called(op, "body")
                             + _called(op, "condition"))
      elif op.op == "conditional":  # the most expensive branch
        total += max([walk(c, traffic) for k in ("branch_computations", "true_computation",
                                                 "false_computation") for c in _called(op, k)])
      elif op.op == "call" or (op.op.startswith("async") or op.op.endswith("-start")) and \
          _called(op, "calls"):
        total += sum(walk(c, traffic) for c in _called(op, "calls") + _called(op, "to_apply"))
      elif traffic:
        if op.op == "fusion":
          total += sum(_fusion_bytes(op, comp, comps.get(c, {})) for c in _called(op, "calls"))
        elif op.op not in _FREE:
          total += _nbytes(op.shape) + sum(_nbytes(comp[a].shape) for a in op.args if a in comp)
      elif op.op in ("dot", "convolution"):
        total += _matmul_flops(op, comp)
      elif op.op == "fusion":
        total += sum(walk(c, traffic) for c in _called(op, "calls"))
    memo[(name, traffic)] = total
    return total

  return walk(entry, False), walk(entry, True)


# ------------------------------------------------------------------------ abstract inputs
