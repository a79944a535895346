"""realm-jax: REALM retrieval-augmented language model pre-training in JAX/Flax."""

__version__ = "0.1.0"
