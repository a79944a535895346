"""Static reads of the package's source (the layout test and the lock's import check)."""

import ast
import os

from tests.conftest import REPO

PKG = os.path.join(REPO, "realm_jax")


def _is_module(name: str) -> bool:
    path = os.path.join(os.path.dirname(PKG), *name.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def module_imports(path: str) -> set[str]:
    """The realm_jax modules a file imports, anywhere in it (functions included), with
    `from realm_jax.x import y` read as the module realm_jax.x.y when y is one."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("realm_jax"):
            subs = {f"{node.module}.{a.name}" for a in node.names}
            found = {s for s in subs if _is_module(s)}
            out |= found
            if len(found) < len(subs):  # names defined in node.module itself
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("realm_jax")}
    return out
