"""What a compiled program communicates, read from XLA's optimized HLO text.

`collectives(compiled.as_text())` lists every cross-device collective the compiler kept
(all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute, their async -start
forms): its kind, the arrays it produces, the bytes a device holds of them, the size of its
device groups, whether it sits inside a loop, and how many times one run of the program
executes it (the product of the enclosing while loops' `known_trip_count`s). `summary` totals
bytes per step by kind. `plan` prints both, and the tests hold each program to the bounds of
../shared/DESIGN.md "What each program should communicate" (tests/integration/test_comms.py).

Bytes are those of the collective's result on one device (an all-gather's gathered output, an
all-reduce's reduced array, a reduce-scatter's scattered shard's input, ...): what that device
must hold, and within a factor of two what crosses its links (ring algorithms send
(g - 1) / g of it, twice for an all-reduce). Text parsing, not XLA's API: the optimized module
is only exposed as text, and its grammar for these lines has been stable across XLA versions.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_CALLEES = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    name: str  # the instruction's name in the module
    shapes: tuple  # ((dtype, dims), ...) of the result (a tuple for a combined collective)
    bytes: int  # the result's bytes on one device
    group_size: int  # devices in each replica group (collective-permute: 2)
    computation: str
    in_loop: bool  # inside a while loop's body (or condition)
    count: int  # executions per run of the program (loop trip counts multiplied)
    trip_known: bool  # every enclosing loop had a known trip count

    @property
    def bytes_per_step(self) -> int:
        return self.bytes * self.count

    def describe(self) -> str:
        arrays = ", ".join(f"{t}[{','.join(map(str, d))}]" for t, d in self.shapes[:4])
        if len(self.shapes) > 4:
            arrays = f"{len(self.shapes)} arrays ({arrays}, ...)"
        loop = f" x{self.count} in a loop" if self.in_loop else ""
        return f"{self.kind} of {arrays} over {self.group_size} devices{loop}"


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype in _DTYPE_BYTES or dtype.startswith("f8"):
            out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def _nbytes(arrays) -> int:
    return sum(math.prod(d) * _DTYPE_BYTES.get(t, 1) for t, d in arrays)


def _group_size(attrs: str, num_devices: int | None) -> int:
    """Devices per replica group, from any of XLA's three spellings."""
    m = re.search(r"replica_groups=\{(\{[^}]*\})", attrs)
    if m:
        return len([x for x in m.group(1).strip("{}").split(",") if x.strip()]) or 1
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    return num_devices or 1


def _result_arrays(kind: str, opcode: str, shape_text: str):
    """The result arrays of a collective; an async -start's tuple holds (operands, results,
    ...): keep the results."""
    arrays = _arrays(shape_text)
    if not opcode.endswith("-start") or len(arrays) < 2:
        return arrays
    if kind == "collective-permute":
        return arrays[:1]
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return arrays[len(arrays) // 2 :]
    return arrays


def _parse(hlo_text: str):
    """(computations: name -> [instruction lines], entry name, callees: name -> [(callee,
    factor, is_loop)])."""
    comps, entry, current = defaultdict(list), None, None
    for line in hlo_text.splitlines():
        m = _HEADER.match(line)
        if m:
            current = m.group(2)
            entry = current if m.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
        elif current is not None and "=" in line:
            comps[current].append(line)
    callees = defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            trip = _TRIP.search(line)
            n = int(trip.group(1)) if trip else None
            for role, callee in _CALLEES.findall(line):
                if role == "to_apply":  # a reduction's scalar computation: no collectives
                    continue
                loop = role in ("body", "condition")
                factor = (n if n is not None else 1) + (role == "condition")
                callees[name].append((callee, factor if loop else 1, loop, loop and n is None))
            for branches in _BRANCHES.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", branches):
                    callees[name].append((callee, 1, False, False))
    return comps, entry, callees


def _multipliers(entry, callees):
    """name -> (executions per run, inside a loop, every trip count known), from ENTRY."""
    out = {entry: (1, False, True)}
    stack = [entry]
    while stack:
        name = stack.pop()
        count, in_loop, known = out[name]
        for callee, factor, loop, unknown in callees.get(name, ()):
            new = (count * factor, in_loop or loop, known and not unknown)
            old = out.get(callee)
            if old is None or new[0] > old[0]:
                out[callee] = new
                stack.append(callee)
    return out


def collectives(hlo_text: str, num_devices: int | None = None, mult=None) -> list[Collective]:
    """Every collective in an optimized HLO module (compiled.as_text()). mult: computation ->
    (runs per program run, in a loop, trips known), where XLA wrote no trip counts (XLA:TPU:
    hlo_cost.loop_multipliers infers them from the loops' conditions); default from the
    module's known_trip_count annotations."""
    comps, entry, callees = _parse(hlo_text)
    if mult is None:
        mult = _multipliers(entry, callees) if entry else {}
    found = []
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, shape_text, opcode, rest = m.groups()
            kind = opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            arrays = _result_arrays(kind, opcode, shape_text)
            group = 2 if kind == "collective-permute" else _group_size(rest, num_devices)
            count, in_loop, known = mult.get(comp, (1, False, False))
            found.append(
                Collective(
                    kind, name, tuple(arrays), _nbytes(arrays), group, comp, in_loop, count, known
                )
            )
    return found


def summary(found: list[Collective]) -> dict:
    """Per kind: {count: instructions, executions: per run, bytes: per device per run}."""
    out = {}
    for c in found:
        s = out.setdefault(c.kind, {"instructions": 0, "executions": 0, "bytes": 0})
        s["instructions"] += 1
        s["executions"] += c.count
        s["bytes"] += c.bytes_per_step
    return out


def total_bytes(found: list[Collective]) -> int:
    return sum(c.bytes_per_step for c in found)


def having_dim(found: list[Collective], sizes) -> list[Collective]:
    """The collectives whose result has a dimension of one of these sizes (a vocabulary, an
    index's rows): the test's way to say 'never gather that table'."""
    sizes = set(int(s) for s in sizes)
    return [c for c in found if any(d in sizes for _, dims in c.shapes for d in dims)]
