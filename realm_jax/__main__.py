"""`python -m realm_jax`: the CLI; its exit status is the command's."""

import sys

from realm_jax.cli import main

sys.exit(main())
