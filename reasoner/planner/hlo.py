"""FLOPs, HBM traffic and collectives of a compiled XLA program, read from its HLO text.

XLA's cost analysis counts a while loop's body once, so a `lax.scan` of K steps (the chunked
head) or the sampler's decode loop would count as one step. `analyse` walks every computation
instead, loop bodies multiplied by their trip count (XLA's `known_trip_count`, else the loop's
induction variable or its condition's bound):
- FLOPs of every matmul and convolution;
- HBM bytes: operands + results of each unfused op or fusion (slices at their size), only of
  arrays in memory space 0. TPU's compiled HLO marks arrays in on-chip memory with `S(n)` in
  their layout (VMEM `S(1)`); a prefetch (`copy-start`) counts its HBM source once, the
  on-chip copy and its `-done` nothing;
- every collective (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute,
  sync or `-start`ed, in fusions too): its kind, group size and bytes, counted per run. TPU
  splits one asynchronous collective into a start fusion, continuation fusions (fused with the
  compute that overlaps it) and a done fusion, each holding the op with the same channel_id:
  inside fusions a collective counts once per channel_id of the computation that runs them.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from reasoner.chips import Collective

_ARRAY = re.compile(r"\b(pred|bf16|[suf]\d+|f8\w*|c64|c128)\[([\d,]*)\](\{[^}]*\})?")
_ITEM = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_CONTROL = {"while", "conditional", "call", "async-start", "async-update", "async-done"}
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


def _nbytes(shape: str, hbm_only: bool = True) -> float:
  """Bytes of the arrays in an HLO shape; `hbm_only`: of those in HBM, memory space 0 (a
  layout without `S(n)`; TPU marks on-chip VMEM S(1), scalar memory S(2) and others)."""
  size = lambda dt: _ITEM.get(dt) or max(1, int(re.sub(r"\D", "", dt.split("e")[0])) // 8)
  return sum(math.prod(int(d) for d in dims.split(",") if d) * size(dt)
             for dt, dims, layout in _ARRAY.findall(shape)
             if not (hbm_only and re.search(r"S\([1-9]\d*\)", layout)))


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
  return _Op(name, shape, rest[:k], re.findall(r"%([\w.\-]+(?:#\d+)?)", text_args),
             rest[j + 1:], text_args)


def _element(shape: str, k: int) -> str:
  """The k-th element of a tuple shape `(a, b, ...)`."""
  s = re.sub(r"/\*.*?\*/", "", shape).strip()[1:-1]
  depth, start, parts = 0, 0, []
  for i, ch in enumerate(s):
    depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
    if ch == "," and depth == 0:
      parts.append(s[start:i])
      start = i + 1
  parts.append(s[start:])
  return parts[k].strip() if k < len(parts) else ""


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
      for a in op.args:  # GPU's `%t#k`: element k of tuple t, as a get-tuple-element
        base, _, k = a.partition("#")
        if k and a not in current and base in current:
          current[a] = _Op(a, _element(current[base].shape, int(k)), "get-tuple-element",
                           [base], f", index={k}", base)
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


def _gemm(op: _Op, comp: dict[str, _Op]) -> tuple[float, float]:
  """(FLOPs, HBM bytes) of a GPU library matmul (`__cublas$gemm`, `__cublas$lt$matmul`): its
  result is (product, workspace), and only the product is written."""
  product = _element(op.shape, 0) if op.shape.startswith("(") else op.shape
  lhs = _dims(comp[op.args[0]].shape) if op.args and op.args[0] in comp else []
  m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', op.attrs)
  k = math.prod(lhs[int(i)] for i in re.findall(r"\d+", m.group(1))) if m and lhs else 1
  reads = sum(_nbytes(comp[a].shape) for a in op.args if a in comp)
  return 2.0 * math.prod(_dims(product)) * k, reads + _nbytes(product)


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


def _group(op: _Op) -> int:
  """Chips in each group of a collective: `replica_groups={{0,1,..}}`, the iota form
  `[groups,size]<=[n]`, the mesh form `mesh['a'=2,'b'=4] {'b'}`, or 2 for a permute."""
  if op.op.startswith("collective-permute"):
    return 2
  attrs = op.attrs
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[\d+,(\d+)\]", attrs)
  if m:
    return int(m.group(1))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
  if m:
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
  return 1


@dataclasses.dataclass
class Cost:
  """A program's (or loop body's) FLOPs, HBM bytes and collectives (op -> count per run)."""

  flops: float = 0.0
  bytes: float = 0.0
  kernels: float = 0.0  # ops launched on their own (fusions, library calls, copies), per run
  # each kernel's own bound, summed (`analyse(ridge=)`): the FLOPs of those whose FLOPs per
  # byte pass the chip's ridge point, the bytes of the others
  serial_flops: float = 0.0
  serial_bytes: float = 0.0
  collectives: dict[Collective, float] = dataclasses.field(default_factory=dict)
  loops: list[tuple[int, "Cost"]] = dataclasses.field(default_factory=list)  # (trips, body)
  # a fusion body's collectives by channel_id, which the computation that runs the fusions
  # counts once per channel (TPU's async start, continuations and done each hold the op)
  channels: dict[str, Collective] = dataclasses.field(default_factory=dict)

  def add(self, other: "Cost", times: float = 1.0) -> "Cost":
    self.flops += times * other.flops
    self.bytes += times * other.bytes
    self.kernels += times * other.kernels
    self.serial_flops += times * other.serial_flops
    self.serial_bytes += times * other.serial_bytes
    for c, n in other.collectives.items():
      self.collectives[c] = self.collectives.get(c, 0.0) + times * n
    self.channels.update(other.channels)
    return self

  def bound_kernel(self, bytes0: float, flops0: float, ridge: float) -> None:
    """The kernel just counted (the bytes and FLOPs added since `bytes0`, `flops0`) into the
    sum of its bound: FLOPs past the ridge point (FLOPs a byte), else bytes."""
    db, df = self.bytes - bytes0, self.flops - flops0
    if df > ridge * db:
      self.serial_flops += df
    else:
      self.serial_bytes += db

  @property
  def num_collectives(self) -> float:
    return sum(self.collectives.values())

  def decode_loop(self) -> tuple[int, "Cost"] | None:
    """The loop with the most trips (the sampler's decode loop) and one trip's cost."""
    return max(self.loops, key=lambda t: t[0], default=None)


def _collective(op: _Op, comp: dict[str, _Op]) -> Collective | None:
  kind = re.sub(r"-start$", "", op.op)
  if kind not in _COLLECTIVES:
    return None
  shape = comp[op.args[0]].shape if kind == "reduce-scatter" and op.args[0] in comp else op.shape
  if op.op.endswith("-start"):  # (operands, results, contexts): the results' half
    arrays = _ARRAY.findall(shape.split("u32[]")[0] if "u32[]" in shape else shape)
    half = arrays[len(arrays) // 2:] if len(arrays) > 1 else arrays
    size = sum(_nbytes(f"{dt}[{dims}]") for dt, dims, _ in half)
  else:
    size = _nbytes(shape, hbm_only=False)
  return Collective(kind, _group(op), size)


def sum_costs(costs) -> Cost:
  total = Cost()
  for c in costs:
    total.add(c)
  return total


def analyse(text: str, ridge: float = 0.0) -> Cost:
  """FLOPs, HBM bytes, collectives (where they run, fusions included: TPU wraps asynchronous
  ones in fusions; a `-start`/`-done` pair once) and kernels of a compiled HLO module, loop
  bodies once per trip, a conditional at its costliest branch; by `ridge` (FLOPs a byte), each
  kernel's own bound summed (`Cost.serial_*`: a GPU's time, kernels one after another)."""
  comps, entry = parse_hlo(text)
  memo: dict[tuple[str, bool], Cost] = {}

  def walk(name: str, top: bool) -> Cost:
    """`top`: a computation run on its own (its ops read and write buffers), else a fusion's."""
    if (name, top) in memo:
      return memo[(name, top)]
    comp, total = comps.get(name, {}), Cost()
    for op in comp.values():
      called = lambda k: _called(op, k)
      control = op.op in _CONTROL or op.op.endswith("-start") and bool(called("calls"))
      total.kernels += top and not (control or op.op in _FREE or op.op.endswith("-done"))
      b0, f0 = total.bytes, total.flops
      if op.op == "while":
        trips = _trip_count(op, comp, comps)
        body = sum_costs(walk(c, True) for c in called("body") + called("condition"))
        total.add(body, trips)
        total.loops += [(trips, body)] + [(t * trips, b) for t, b in body.loops]
      elif op.op == "conditional":
        branches = [walk(c, True) for k in ("branch_computations", "true_computation",
                                            "false_computation") for c in called(k)]
        total.add(max(branches, key=lambda b: (b.bytes, b.flops, b.num_collectives),
                      default=Cost()))
      elif op.op in ("call", "async-start") or op.op.endswith("-start") and called("calls"):
        for c in called("calls") + called("to_apply"):
          total.add(walk(c, top))
      elif (coll := _collective(op, comp)) is not None:
        channel = re.search(r"channel_id=(\d+)", op.attrs)
        if coll.group > 1 and not top and channel:
          total.channels[channel.group(1)] = coll
        elif coll.group > 1:  # a group of one chip moves nothing
          total.collectives[coll] = total.collectives.get(coll, 0.0) + 1
        total.bytes += _op_bytes(op, comp) if top else 0.0
      elif op.op == "fusion":
        if top:
          total.bytes += sum(_fusion_bytes(op, comp, comps.get(c, {})) for c in called("calls"))
        for c in called("calls"):
          total.add(walk(c, False))
      elif op.op in ("dot", "convolution") or op.op == "custom-call" and "__cublas" in op.attrs:
        flops, nbytes = (_gemm(op, comp) if op.op == "custom-call" else
                         (_matmul_flops(op, comp), _op_bytes(op, comp)))
        total.flops += flops
        total.bytes += nbytes if top else 0.0
      elif top:
        total.bytes += _op_bytes(op, comp)
      if top and not control:
        total.bound_kernel(b0, f0, ridge)
    if top:  # the fusions' collectives, once per channel
      for coll in total.channels.values():
        total.collectives[coll] = total.collectives.get(coll, 0.0) + 1
      total.channels = {}
    memo[(name, top)] = total
    return total

  return walk(entry, True)


def _op_bytes(op: _Op, comp: dict[str, _Op]) -> float:
  """HBM bytes an unfused op reads and writes; a slice or an in-place update only its part; a
  `-start` its operands (its results are the copies in flight), a `-done` none (counted at
  its start)."""
  if op.op in _FREE or op.op.endswith("-done") or op.op == "async-update":
    return 0.0
  shape = lambda a: comp[a].shape if a in comp else ""
  if op.op in ("slice", "dynamic-slice", "slice-start"):  # reads only its part of the source
    result = op.shape  # slice-start: ((source), result, context), a prefetch of the part
    if op.op == "slice-start":
      dt, dims, layout = _ARRAY.findall(op.shape)[-2]
      result = f"{dt}[{dims}]{layout}"
    part = _nbytes(result, hbm_only=False)
    return (part if _nbytes(shape(op.args[0])) else 0.0) + _nbytes(result)
  if op.op == "dynamic-update-slice":  # in place: reads and writes only the update
    update = shape(op.args[1])
    return _nbytes(update) + (_nbytes(update, hbm_only=False) if _nbytes(op.shape) else 0.0)
  reads = sum(_nbytes(comp[a].shape) for a in op.args if a in comp)
  return reads if op.op.endswith("-start") else reads + _nbytes(op.shape)


def hlo_cost(text: str) -> tuple[float, float]:
  """(FLOPs, HBM bytes) of a compiled HLO module, every loop body counted once per trip."""
  cost = analyse(text)
  return cost.flops, cost.bytes

