"""One process of a 2-process refresh job on loopback (4 fake CPU devices each).

usage: refresh_worker.py PORT PROCESS_ID WORKDIR DATA_DIR OVERRIDE...
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, workdir, data_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)

from realm_jax import checkpoint  # noqa: E402
from realm_jax.config import load_config  # noqa: E402
from realm_jax.data import datasets  # noqa: E402
from realm_jax.index.refresher import Refresher  # noqa: E402

repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
config = load_config(os.path.join(repo, "configs", "realm.py") + ":smoke", sys.argv[5:])
refresher = Refresher(config, workdir, datasets.load_blocks(data_dir)[0])
assert refresher.mesh.devices.size == 8 and jax.process_count() == 2
mgr = checkpoint.manager(workdir, with_data=False, read_only=True)
path = refresher.refresh_once(mgr, 0)
print("PUBLISHED", path or "-", flush=True)
jax.distributed.shutdown()
