"""`python -m realm_jax.sweep CONFIG_FILE[:VARIANT]`: print the points (tpu/sweep.sh)."""

import sys

from realm_jax.sweep.points import main

sys.exit(main())
