"""Does `configs/realm.py:base` fit a TPU pod slice? `realm-jax plan` for several settings.

    make plan            # .venv-plan (with libtpu) runs this: TPU compiler figures
    python benchmarks/plan_base.py [--only NAME,...] [--out runs/plan]

Each setting is one `python -m realm_jax plan ... --json` in its own process (compiling
BERT-base x 3 for 64 TPU devices takes minutes); a setting whose JSON is already in --out is
read back, not recompiled (delete it to redo). Writes the "Pod plan: base on TPU slices"
section of docs/benchmarks.md: per-device GiB of parameters, optimizer state, index shards
and XLA's step temporaries, against HBM; and per program its collective bytes a step and
its roofline step time (plan.roofline: compute, HBM traffic and ICI terms, the bound).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402

GiB = 1024**3
BASE = "configs/realm.py:base"
# name -> (topology, overrides): base as configured (remat, bfloat16 activations, replicated
# parameters), then what each of those choices buys.
SETTINGS = {
    "v3-64": ("v3-64", []),
    "v3-64-no-remat-f32": ("v3-64", ["--config.model.remat=false", "--config.model.dtype=float32"]),
    "v3-64-f32": ("v3-64", ["--config.model.dtype=float32"]),
    "v3-64-fsdp": ("v3-64", ["--config.mesh.fsdp=true"]),
    "v4-64": ("v4-64", []),
    "v5e-256": ("v5e-256", []),
    "v5p-128": ("v5p-128", []),
    # the other tasks' base variants on the same slice (ORQA's batches: ICT 4096, QA 64)
    "v3-64 ict": ("v3-64", [], "configs/ict.py:base"),
    "v3-64 qa": ("v3-64", [], "configs/orqa.py:base"),
}


def run(name: str, out_dir: str) -> dict:
    path = os.path.join(out_dir, f"{name.replace(' ', '-')}.json")
    if not os.path.exists(path):
        topology, overrides, *config = SETTINGS[name]
        cmd = [sys.executable, "-m", "realm_jax", "plan", "--config", *(config or [BASE])]
        cmd += ["--topology", topology, "--json", path, *overrides]
        print("$", " ".join(cmd), flush=True)
        env = dict(os.environ, JAX_PLATFORMS="cpu")  # compile-only: no TPU is looked for
        subprocess.run(cmd, cwd=REPO, env=env)  # exit 2 = does not fit: figures still written
    with open(path) as f:
        return json.load(f)


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def table(results: dict) -> str:
    rows = [
        "| setting | step | devices (hosts) | per device: params | optimizer | index shards | "
        "step temporaries | step total | of HBM | refresh total | compile |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        h, progs = r["header"], r["programs"]
        train = progs[0]
        refresh = next((p for p in progs if p["program"].startswith("refresh")), None)
        g = train["groups"]
        index = g.get("block embeddings shard", 0) + g.get("token table shard", 0)
        if train["total"] is not None:
            temps = _gib(train["xla"]["temporaries"])
            verdict = "fits" if train["fits"] else "DOES NOT FIT"
            share = f"{train['total'] / h['hbm_bytes']:.0%} {verdict}"
        else:  # XLA:TPU refuses at compile time, naming what the temporaries would need
            need = re.search(r"temporaries \(([\d.]+)G\)", train["compiler_error"])
            temps = f"{need.group(1)} (compiler)" if need else "-"
            share = "DOES NOT FIT: refused by the compiler"
        rows.append(
            f"| {name} | {train['program']} | {h['devices']} ({h['hosts']}) | "
            f"{_gib(g['parameters'])} | "
            f"{_gib(g['optimizer state'])} | {_gib(index)} | {temps} | "
            f"{_gib(train['total'])} | {share} | "
            f"{_gib(refresh['total']) if refresh else '-'} | {train['compile_seconds']:.0f} s |"
        )
    return "\n".join(rows)


def _secs(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def time_table(results: dict, hand: dict) -> str:
    """Per program: FLOPs, HBM traffic and collectives per device a run, the roofline's
    terms (s), the step time and its bound, the compile time."""
    rows = [
        "| setting | program | TFLOP per device (hand count) | HBM traffic (GiB) | "
        "collectives (MiB) | compute (s) | memory (s) | communication (s) | roofline "
        "step (s) | bound | compile |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        for p in r["programs"]:
            rf = p.get("roofline")
            if rf is None:
                rows.append(f"| {name} | {p['program']} | did not compile | | | | | | | | |")
                continue
            sec = rf["seconds"]
            count = f"{rf['flops'] / 1e12:.3f}"
            if p["program"].startswith("REALM train") and name in hand:
                count += f" ({hand[name] / 1e12:.3f})"
            rows.append(
                f"| {name} | {p['program']} | {count} | {rf['hbm_bytes'] / GiB:.1f} | "
                f"{rf['comm_bytes'] / 2**20:,.1f} | {_secs(sec['compute'])} | "
                f"{_secs(sec['memory'])} | {_secs(sec['communication'])} | "
                f"**{_secs(rf['step_seconds'])}** | {rf['bound']} | "
                f"{p['compile_seconds']:.0f} s |"
            )
    return "\n".join(rows)


def _audit_vs_trips(results: dict) -> str:
    """Where the JSONs' communication audit counted a TPU loop's collectives once (hlo_audit
    before it read trips from the loops' conditions): the first train step's two figures."""
    name, r = next(iter(results.items()))
    p = r["programs"][0]
    if "roofline" not in p or "communication" not in p:
        return ""
    audit, rf = p["communication"]["total_bytes"], p["roofline"]["comm_bytes"]
    if audit >= 0.99 * rf:
        return ""
    return (
        f" (the audit in these JSONs counted a TPU loop's collectives once: {name}'s "
        f"{audit / 2**20:,.0f} MiB against {rf / 2**20:,.0f})"
    )


def hand_counts(results: dict) -> dict:
    """benchmarks/flops.py's count of one REALM step as executed (refresh_scale's, with the
    rematerialised forward) over the devices, for the REALM settings."""
    from benchmarks.refresh_scale import executed_train_flops
    from realm_jax.config import load_config

    out = {}
    for name, r in results.items():
        topology, overrides, *config = SETTINGS[name]
        if config:
            continue
        c = load_config(BASE, [o.removeprefix("--config.") for o in overrides])
        h = r["header"]
        out[name] = executed_train_flops(c, h["num_blocks"]) / h["devices"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated settings (default: all)")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "plan"))
    p.add_argument("--no-write", action="store_true", help="print, do not write the doc")
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="NAME=WHY",
        help="a setting not compiled, and why (the doc says so); repeatable",
    )
    p.add_argument("--note", action="append", default=[], help="a line for the doc")
    args = p.parse_args()
    skipped = dict(x.split("=", 1) for x in args.skip)
    names = args.only.split(",") if args.only else list(SETTINGS)
    os.makedirs(args.out, exist_ok=True)
    results = {n: run(n, args.out) for n in names if n not in skipped}
    first = next(iter(results.values()))["header"]
    body = "\n".join(
        [
            f"`python benchmarks/plan_base.py` (`make plan`): `realm-jax plan --config {BASE}` "
            f"compiled ahead of time by {first['compiler']}, on a machine without a TPU. "
            "Figures are per device, GiB, from XLA's compiled memory analysis (step total = "
            "arguments + outputs not aliased to them + temporaries + generated code). base: "
            "BERT-base x 3 (query embedder, document embedder, reader), global batch 512, 8 "
            "candidates, query 96, block 288, 13,353,718 blocks; as configured it "
            "rematerialises each layer (a scan under jax.checkpoint) and computes in "
            "bfloat16 with float32 parameters, Adam state and LayerNorm statistics.",
            "",
            table(results),
            "",
            "Time per device from the same compiled programs: `plan`'s roofline takes XLA's "
            "cost analysis of the partitioned program (one device's FLOPs and bytes "
            "accessed; XLA counts a while loop's body once, so plan adds the other trips "
            "of each loop: the layers' scan under remat, the loss's vocabulary chunks, "
            "the refresh's embedding chunks; XLA:TPU writes no trip counts, so plan reads "
            "them from each loop's condition) and the result bytes of its collectives, "
            f"each times its loop's trips{_audit_vs_trips(results)}, and "
            "divides them by the chip's published bf16 peak, HBM bandwidth and "
            "bidirectional ICI bandwidth per device (`plan.FAMILIES`; Cloud TPU publishes "
            "no per-chip ICI figure for v3 or v4, so their communication term is left "
            "out). Step time = the largest term: a lower bound (100% of peak, every byte "
            "at full bandwidth, no overlap lost); HBM traffic is XLA's bytes accessed, each "
            "fusion's operands and results, so attention's [batch, heads, L, L] scores "
            "count as they go through HBM. The refresh row is one whole run: the "
            "device's share of all 13,353,718 blocks. In brackets: benchmarks/flops.py's "
            "hand count of the step as executed (3x forward + the rematerialised forward) "
            "over the devices.",
            "",
            time_table(results, hand_counts(results)),
            "",
            "Settings: `v3-64` is `configs/realm.py:base` as configured (`ict` and `qa`: "
            "`configs/ict.py:base`, batch 4096 query/block pairs, and "
            "`configs/orqa.py:base`, 64 questions, retriever beam 5000, reader beam 5, reader "
            "length 320, with the same model settings); `-no-remat-f32` turns both off, `-f32` "
            "keeps remat with float32 activations, `-fsdp` also shards parameters and Adam "
            "state over the data axis (`--config.mesh.fsdp=true`); HBM is 16 GiB per v3 "
            "TensorCore, 32 GiB per v4 chip (megacore), 16 GiB per v5e chip, 95 GiB per v5p chip "
            "(megacore). Compile times are wall-clock on a "
            "shared 2-core machine.",
        ]
        + [f"\nNot measured: `{n}`: {why}" for n, why in skipped.items()]
        + [f"\n{note}" for note in args.note]
    )
    print(body)
    if not args.no_write:
        write_section("Pod plan: base on TPU slices", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
