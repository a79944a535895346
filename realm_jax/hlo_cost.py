"""What XLA's cost analysis leaves out of a compiled program: the work of its loops' later
trips. `compiled.cost_analysis()` counts a while loop's body once, so a program whose layers
run in a scan (model.remat) or whose micro-batches do (train.grad_accum) reports a fraction of
its FLOPs: `loop_cost` adds (n - 1) times each computation's matmul FLOPs and unfused bytes
for a computation run n times a step, the trips from hlo_audit's multipliers (XLA's
known_trip_count, else inferred from the loop's condition, as XLA:TPU writes none). Read by
`plan`'s roofline and by the training loop's MFU (train/instruments.py)."""

from __future__ import annotations

import math
import re

# Instructions that move no HBM bytes of their own (a loop's body is counted through its
# multiplier, not through its while instruction).
_NO_TRAFFIC = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
    "conditional", "after-all", "partition-id", "replica-id", "opt-barrier",
}  # fmt: skip
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def _operands(rest: str) -> list[str]:
    """The operand names of an instruction (the text after its opcode's parenthesis)."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def _taps(size_in: int, kernel: int, out: int, w: dict, d: int) -> int:
    """(output position, kernel tap) pairs of one spatial dimension that read real input
    (not padding, not a hole of lhs dilation)."""
    stride, ld, rd = (
        int(w.get(k, ["1"] * (d + 1))[d]) for k in ("stride", "lhs_dilate", "rhs_dilate")
    )
    lo = int(w["pad"][d].split("_")[0]) if "pad" in w else 0
    span = (size_in - 1) * ld
    return sum(
        1
        for k in range(kernel)
        for j in range(out)
        if 0 <= (p := j * stride + k * rd - lo) <= span and p % ld == 0
    )


def _matmul_flops(opcode: str, rest: str, out, operands) -> float:
    """2 x multiply-adds: a dot's output elements x its contracting size; a convolution's
    (XLA:TPU's matmuls: heads and chunks as spatial dimensions, windows with padding and
    dilation) batch x output features x input features a group x the taps that read input."""
    lhs, rhs = operands[0], operands[1]
    if not out or not lhs or not rhs:
        return 0.0
    out, lhs, rhs = out[0][1], lhs[0][1], rhs[0][1]
    if opcode == "dot":
        dims = _CONTRACTING.search(rest)
        k = math.prod(lhs[int(d)] for d in dims.group(1).split(",") if d) if dims else 1
        return 2.0 * math.prod(out) * k
    labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", rest)
    if not labels:
        return 0.0
    li, ki, oi = labels.groups()
    window = re.search(r"window=\{([^}]*)\}", rest)
    w = dict(x.split("=") for x in window.group(1).split()) if window else {}
    w = {k: v.split("x") for k, v in w.items()}
    taps = 1
    for d in range(sum(c.isdigit() for c in li)):
        c = str(d)
        taps *= _taps(lhs[li.index(c)], rhs[ki.index(c)], out[oi.index(c)], w, d)
    return 2.0 * out[oi.index("b")] * out[oi.index("f")] * rhs[ki.index("i")] * taps


def _computation_cost(lines, fused: bool, trips: int = 0) -> tuple[float, float]:
    """(matmul FLOPs, operand + result bytes outside fusions) of one computation's
    instructions; in a loop body of `trips` trips an array stacked over them (a scan's xs
    and ys: leading dimension = trips) counts one slice, the part a trip reads or writes."""
    from realm_jax import hlo_audit

    def nbytes(arrays):
        return sum(
            hlo_audit._nbytes([a]) // (trips if trips > 1 and a[1][:1] == (trips,) else 1)
            for a in arrays
        )

    parsed = [m.groups() for m in map(hlo_audit._INSTR.match, lines) if m]
    shapes = {name: hlo_audit._arrays(shape) for name, shape, _, _ in parsed}
    flops = traffic = 0.0
    for name, _, opcode, rest in parsed:
        ops = _operands(rest)
        if opcode in ("dot", "convolution") and len(ops) > 1:
            flops += _matmul_flops(opcode, rest, shapes[name], [shapes.get(o) for o in ops])
        if not fused and opcode not in _NO_TRAFFIC:
            arrays = shapes[name] + [a for o in ops for a in shapes.get(o, [])]
            traffic += nbytes(arrays)
    return flops, traffic


_WHILE = re.compile(r"condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_LOOP_TEST = re.compile(r"compare\(%([\w.\-]+), %([\w.\-]+)\), direction=(LT|LE)")
_CONST = re.compile(r"%([\w.\-]+) = [su]\d+\[\][^=]*constant\((\d+)\)")


def _trip_counts(hlo_text: str, comps) -> dict:
    """{body: trips} of every loop: XLA's known_trip_count where it wrote one, else (XLA:TPU
    writes none) from a condition `counter < N` (or <= N) on the tuple's element 0 against
    a constant N, the counter from 0 as jax's scan and fori_loop start it."""
    from realm_jax import hlo_audit

    out = {}
    for line in hlo_text.splitlines():
        loop = _WHILE.search(line)
        if not loop or " while(" not in line:
            continue
        cond, body = loop.groups()
        if known := hlo_audit._TRIP.search(line):
            out[body] = int(known.group(1))
            continue
        lines = comps.get(cond, [])
        consts = dict(_CONST.findall("\n".join(lines)))
        test = next((m for m in map(_LOOP_TEST.search, lines) if m), None)
        counter = "".join(x for x in lines if test and f"%{test.group(1)} =" in x)
        if test and test.group(2) in consts and "index=0" in counter:
            out[body] = int(consts[test.group(2)]) + (test.group(3) == "LE")
    return out


def loop_multipliers(hlo_text: str):
    """(computations, name -> (runs per step, in a loop, trips known), {body: trips}):
    hlo_audit's multipliers, with the trips XLA did not annotate inferred (_trip_counts)."""
    from realm_jax import hlo_audit

    comps, entry, callees = hlo_audit._parse(hlo_text)
    trips = _trip_counts(hlo_text, comps)
    conds = {c: b for c, b in _WHILE.findall(hlo_text)}
    fixed = {}
    for name, calls in callees.items():
        fixed[name] = []
        for c, f, loop, unknown in calls:
            n = trips.get(c, trips.get(conds.get(c)))
            if unknown and n is not None:  # a condition runs once more than its body
                f, unknown = n + (c in conds), False
            fixed[name].append((c, f, loop, unknown))
    return comps, (hlo_audit._multipliers(entry, fixed) if entry else {}), trips


def loop_cost(hlo_text: str) -> tuple[float, float]:
    """(FLOPs, bytes) XLA's cost analysis leaves out: it counts a while loop's body once, so
    each computation that runs n > 1 times a step adds (n - 1) x its dots' FLOPs and its
    (unfused) instructions' operand and result bytes (loop_multipliers)."""
    comps, mult, trips = loop_multipliers(hlo_text)
    fused = set(re.findall(r"\sfusion\(.*?calls=%?([\w.\-]+)", hlo_text))
    flops = traffic = 0.0
    for comp, lines in comps.items():
        n = mult.get(comp, (1,))[0]
        if n > 1:
            f, b = _computation_cost(lines, comp in fused, trips.get(comp, 0))
            flops, traffic = flops + (n - 1) * f, traffic + (n - 1) * b
    return flops, traffic
