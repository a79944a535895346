"""Write a benchmark's results as a named section of docs/benchmarks.md (other sections kept);
a study in experiments/ passes its own README as `doc`."""

from __future__ import annotations

import datetime
import fcntl
import os
import platform
import re

DOC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks.md"
)
HEADER = (
    "# Benchmarks\n\nEvery figure here is written by a script in `benchmarks/`; "
    "rerun it to refresh its section.\n"
)


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"


def _body(section: str) -> str:
    """A written section's body: the text under its heading and its _Measured ..._ line."""
    lines = section.strip().split("\n")[1:]
    while lines and (not lines[0].strip() or lines[0].startswith("_Measured ")):
        lines = lines[1:]
    return "\n".join(lines).strip()


def write_section(name: str, body: str, doc: str = DOC) -> bool:
    """Replace (or append) the section `## name` in docs/benchmarks.md (or `doc`); False where
    it already held these figures (left as it was, its stamp too)."""
    os.makedirs(os.path.dirname(doc), exist_ok=True)
    # two studies finishing at once (each reads, edits and writes the doc) must not lose a section
    with open(f"{doc}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _write_section(name, body, doc)


def _write_section(name: str, body: str, doc: str) -> bool:
    if os.path.exists(doc):
        text = open(doc).read()
    else:
        text = HEADER if os.path.abspath(doc) == os.path.abspath(DOC) else ""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = f"## {name}\n\n_Measured {stamp} on {machine()}._\n\n{body.strip()}\n\n"
    pattern = re.compile(rf"^## {re.escape(name)}\n.*?(?=^## |\Z)", re.S | re.M)
    old = pattern.search(text)
    if old and _body(old.group(0)) == body.strip():
        # the same figures written again (a report rerun from kept results): the section keeps
        # the stamp of when they were measured, not the rerun's
        print(f"section {name!r} in {doc} unchanged")
        return False
    if old:
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(doc, "w") as f:
        f.write(text)
    print(f"wrote section {name!r} to {doc}")
    return True
