"""The pod rehearsal (`make pod-rehearsal`): the paper's chain run on this machine as a real
multi-host job on gs://, each stage compared with the same stage run as one process on local
disk.

Every multi-host command runs as 2 `jax.distributed` processes x 2 fake CPU devices (2 hosts
of a slice), each process with its own cache folder (a host's disk). The workdirs, the data
dir, the corpus, the question file and the BERT weights (../shared's bert-tiny, when there)
live on gs:// in fake-gcs-server (memory backend), started on a free loopback port. The
reference chain runs every stage as 1 process x 4 devices on local disk, starting from a local
copy of the checkpoints the pod chain's previous stage wrote (so each stage is compared on its
own: the prepared records are compared first and are identical).

    prepare   Beam's local runner into the gs:// data dir   vs in process, locally: every record
    ict       2 x 2, held-out evaluation on                  vs 1 x 4: losses, recall@k
    realm     trainer 2 x 2 + the refresh job as its own 2 x 2 job (a second slice), lockstep
              swaps (refresh.lockstep)                       vs 1 x 4 in-process refresh: losses
    kill -9   one trainer process killed mid-run: the other must exit within a bound; the
              relaunch continues                             vs the uninterrupted run: losses
    resume    the 2-process run resumed by 1 process x 4 devices (another host count)
    finetune  2 x 2, warm start from the gs:// REALM workdir vs 1 x 4: losses, dev EM
    evaluate  2 x 2, outputs to gs://                         vs 1 x 4: EM, predictions
    ask       1 process on the gs:// workdir                  vs local: the answer
    errors    an unreachable bucket, a gs:// workdir with no checkpoints, a process count
              that does not divide the batch: one line, exit 2

    python acceptance/pod_rehearsal.py            # the whole chain, writes docs/reliability.md
    python acceptance/pod_rehearsal.py --quick    # fewer steps, no faults (tests/system)
    python acceptance/pod_rehearsal.py --quick --faults http_503=0.05,drop=0.02
                                                  # every gs:// request through a fault-injecting
                                                  # proxy (tests/support/fault_proxy.py)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from acceptance import pod_stages as S  # noqa: E402
from acceptance.pod_jobs import StageError  # noqa: E402
from benchmarks._report import write_section  # noqa: E402
from tests.support.fake_gcs import FakeGCS, batch_patch_dir  # noqa: E402
from tests.support.fault_proxy import FaultProxy  # noqa: E402

DOC = os.path.join(REPO, "docs", "reliability.md")


def table(rows: list[S.Row]) -> str:
    lines = [
        "| stage | processes | wall | compared | result |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        mark = "ok" if r.ok else "FAILED"
        lines.append(
            f"| {r.stage} | {r.procs} | {r.wall:.0f} s | {r.compared} | {mark}: {r.result} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps, no faults, no doc")
    p.add_argument(
        "--root",
        default=os.path.join(REPO, "runs", "pod-rehearsal"),
        help="local folder for the reference chain, logs and host caches (wiped)",
    )
    p.add_argument("--no-doc", action="store_true", help="do not write docs/reliability.md")
    p.add_argument(
        "--faults",
        default="",
        help="storage faults per request through a proxy in front of fake-gcs-server, e.g. "
        "http_429=0.05,http_503=0.05,slow=0.02,drop=0.02 (none by default)",
    )
    p.add_argument(
        "--redoc",
        action="store_true",
        help="only rewrite the doc section from ROOT/rehearsal.json (a finished run)",
    )
    args = p.parse_args(argv)
    if args.redoc:
        with open(os.path.join(args.root, "rehearsal.json")) as f:
            done = json.load(f)
        rows = [S.Row(**r) for r in done["rows"]]
        plan = S.Plan.make(args.root, quick=False)
        write_section(
            "Pod rehearsal", S.doc_text(plan, table(rows), done["ok"], done["minutes"]), doc=DOC
        )
        return 0
    t0 = time.time()
    shutil.rmtree(args.root, ignore_errors=True)
    os.makedirs(args.root)
    plan = S.Plan.make(args.root, quick=args.quick)
    rows: list[S.Row] = []
    rates = {k: float(v) for k, v in (kv.split("=") for kv in args.faults.split(",") if kv)}
    with (
        FakeGCS(buckets=(S.BUCKET,), log_path=os.path.join(args.root, "fake-gcs.log")) as gcs,
        FaultProxy(gcs.url, seed=0, slow_s=0.5) if rates else contextlib.nullcontext() as proxy,
    ):
        genv = dict(gcs.env)
        if proxy is not None:  # every client reaches the store through the proxy
            proxy.set(**rates)
            genv = {k: v.replace(gcs.url, proxy.url) for k, v in genv.items()}
        # fake-gcs-server drops batch parts without a Content-ID, which google-cloud-storage
        # (Beam's gs:// renames) leaves out: every child process adds one (tests/fake_gcs.py)
        path = os.pathsep.join(filter(None, (batch_patch_dir(), os.environ.get("PYTHONPATH"))))
        env = {
            **os.environ,
            **genv,
            "JAX_PLATFORMS": "cpu",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": path,
        }
        env.pop("XLA_FLAGS", None)  # the CLI's --cpu_devices sets each process's devices
        os.environ.update(genv)  # this process reads gs:// too (comparisons)
        plan.env = env
        try:
            for stage in S.stages(plan):
                print(f"--- {stage.__name__.removeprefix('stage_')}", flush=True)
                new = stage(plan)
                rows += new
                for r in new:
                    print(
                        f"    {'ok' if r.ok else 'FAILED'}: {r.stage}: {r.result} ({r.wall:.0f} s)",
                        flush=True,
                    )
                if not all(r.ok for r in new) and new[0].fatal:
                    break
        except StageError as e:
            rows.append(S.Row("(stopped)", "-", 0.0, "-", False, str(e).splitlines()[0]))
            print(f"stage failed: {e}", file=sys.stderr)
        finally:
            plan.stop_background()
        if proxy is not None:
            print(f"faults injected: {dict(proxy.counts)}", flush=True)
    minutes = (time.time() - t0) / 60
    out = table(rows)
    print("\n" + out)
    ok = all(r.ok for r in rows)
    print(
        f"\npod rehearsal: {'passed' if ok else 'FAILED'} in {minutes:.1f} min "
        f"(logs in {os.path.join(args.root, 'logs')})"
    )
    with open(os.path.join(args.root, "rehearsal.json"), "w") as f:
        json.dump({"ok": ok, "minutes": minutes, "rows": [r.__dict__ for r in rows]}, f, indent=1)
    if not args.quick and not args.no_doc:
        write_section("Pod rehearsal", S.doc_text(plan, out, ok, minutes), doc=DOC)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
