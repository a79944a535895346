"""One process of a 2-process jax.distributed run on loopback (4 fake CPU devices each)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)

from realm_jax import sharding  # noqa: E402
from realm_jax.index import embedding  # noqa: E402
from realm_jax.pretrain import step as pretrain_step  # noqa: E402
from tests.support.realm_fixtures import synthetic_batch, synthetic_index, tiny_config  # noqa: E402

config = tiny_config()
mesh = sharding.make_mesh(config.mesh)
assert mesh.devices.size == 8 and jax.process_count() == 2
model, optimizer, state, shardings = pretrain_step.create_state(config, mesh, jax.random.key(0))
emb, tokens = synthetic_index(config)
e, t = embedding.pad_index(emb, tokens, mesh)
batch = synthetic_batch(config)
per = config.train.batch_size // 2
local = {k: v[pid * per : (pid + 1) * per] for k, v in batch.items()}  # this process's share
fn = pretrain_step.compile_loss(config, mesh, model, len(emb))
metrics = fn(
    state.params,
    sharding.global_batch(local, mesh),
    sharding.put_rows(e, mesh),
    sharding.put_rows(t, mesh),
)
print("LOSS", float(jax.device_get(metrics["loss"])), flush=True)
jax.distributed.shutdown()
