"""Static reads of the package's source (the layout test and the lock's import check)."""

import ast


def package_imports(path: str) -> set[str]:
    """The realm_jax modules a Python file imports (anywhere in it, functions included)."""
    tree = ast.parse(open(path).read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("realm_jax"):
            if node.module == "realm_jax":
                out |= {f"realm_jax.{a.name}" for a in node.names}
            else:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("realm_jax")}
    return out
