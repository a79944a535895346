"""realm-jax: REALM retrieval-augmented language model pre-training in JAX/Flax.

The Python API (docs/python.md): `realm_jax.load(workdir)` -> a Model that retrieves (dense,
BM25, hybrid), answers (fine-tuned workdirs) and embeds. Imported on first use, so that
`import realm_jax` stays cheap (JAX loads when a model does).
"""

__version__ = "0.1.0"
__all__ = ["Answer", "Hit", "Model", "load"]


def __getattr__(name: str):
    if name in __all__:
        from realm_jax import api

        return getattr(api, name)
    raise AttributeError(f"module 'realm_jax' has no attribute {name!r}")
