"""How noisy is REALM's gradient on the retriever? The gradient noise scale -> stdout / JSON.

    python bench/gradient_noise.py --config configs/realm.py:squad --workdir SCRATCH \
        [--micro 16] [--count 32] [--out FILE.json] [--config.a.b=value ...]

REALM's retriever learns from p(z|x,y) - p(z|x), the reader's posterior over the retrieved
blocks minus the retriever's prior. Where the reader fills the masks about as well with any
block, that difference is small and its sign varies from sentence to sentence: the mean
gradient (the signal) is then small against the spread of per-sentence gradients (the
noise), and an optimizer step on 16 sentences moves the retriever mostly at random. Adam makes
this worse: it scales each step to the learning rate whatever the gradient's size.

This script measures that, per network (query embedder, document embedder, reader), at the
parameters the config starts from (its weight imports: `model.init_embedders_from_ict`,
`model.init_from_realm`, ...), with the index embedded by those same parameters: `count`
gradients of REALM's loss (realm_jax/pretrain/step.realm_loss, no dropout), each over
`micro` training sentences, and their mean over all `micro * count`. From the expected
squared norms of a gradient averaged over b and over B examples,
E|G_b|^2 = |G|^2 + tr(S)/b, E|G_B|^2 = |G|^2 + tr(S)/B, it estimates the true gradient's
squared norm |G|^2 and the per-example covariance's trace tr(S) (McCandlish et al. 2018, "An
Empirical Model of Large-Batch Training", appendix A), and reports

  noise scale  B_noise = tr(S) / |G|^2: the batch at which a step's signal and noise are
               equal in size; a batch far below it takes steps that are mostly noise
  signal share at batch b: |G|^2 / (|G|^2 + tr(S)/b), the expected share of a step's squared
               size that is the true gradient (1: all signal; near 0: all noise)

With few examples |G|^2 can come out negative (signal below what `count` gradients can
resolve): it is reported as such, and B_noise as "> the examples used".
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def noise_scale(sq_small: float, sq_big: float, b: int, big: int) -> dict:
    """|G|^2, tr(S) and B_noise from the mean squared norm of gradients over b examples
    (sq_small) and the squared norm of their mean over `big` examples (sq_big)."""
    g2 = (big * sq_big - b * sq_small) / (big - b)
    trace = (sq_small - sq_big) / (1.0 / b - 1.0 / big)
    out = {"grad_sq": g2, "trace": trace, "noise_scale": trace / g2 if g2 > 0 else float("inf")}
    for batch in (b, 512):
        share = g2 / (g2 + trace / batch) if g2 > 0 else 0.0
        out[f"signal_share_at_{batch}"] = share
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/realm.py:squad")
    ap.add_argument("--workdir", required=True, help="a scratch folder (nothing is trained)")
    ap.add_argument("--micro", type=int, default=16, help="sentences per gradient (b)")
    ap.add_argument("--count", type=int, default=32, help="gradients (B = micro * count)")
    ap.add_argument("--out", default="", help="write the figures here as JSON")
    args, rest = ap.parse_known_args()
    overrides = []
    for a in rest:
        if not a.startswith("--config."):
            ap.error(f"unknown argument {a!r} (config overrides are --config.a.b=value)")
        overrides.append(a[len("--config.") :])
    if args.micro < 1 or args.count < 2:
        ap.error("--micro must be >= 1 and --count >= 2")

    import jax
    import numpy as np

    from realm_jax import fs, sharding
    from realm_jax import workdir as paths
    from realm_jax.config import load_config, validate
    from realm_jax.data import pipeline, prepared
    from realm_jax.index.feed import IndexFeed
    from realm_jax.model.inputs import joint_len
    from realm_jax.pretrain import step as realm_step
    from realm_jax.train.warm_start import params_hook

    config = load_config(args.config, overrides + ["refresh.mode=inprocess"])
    validate(config)
    fs.makedirs(args.workdir)
    mesh = sharding.make_mesh(config.mesh)
    ddir = paths.data_dir(config, args.workdir)
    prepared.check_prepared(config, ddir)
    tokens = prepared.sharded_block_tokens(ddir, mesh, with_titles=False)
    loader = pipeline.train_loader(
        config, ddir, global_batch_size=args.micro, seed=config.data.seed
    )
    model, _, state, _ = realm_step.create_state(
        config, mesh, jax.random.key(config.train.seed), params_hook(config)
    )
    params = state.params
    feed = IndexFeed(config, args.workdir, mesh, model, tokens)
    feed.start(params, 0)
    loss = functools.partial(
        realm_step.realm_loss,
        model=model,
        mesh=mesh,
        num_candidates=config.train.num_candidates,
        num_valid=feed.num_blocks,
        length=joint_len(config),
        vocab_chunk=config.train.mlm_vocab_chunk,
    )
    grad = jax.jit(jax.grad(lambda p, batch, e, t: loss(p, batch, e, t)[0]))
    groups = sorted(params)
    total = {g: None for g in groups}  # the sum of the gradients
    sq = {g: 0.0 for g in groups}  # the sum of their squared norms
    it = iter(loader)
    t0 = time.time()
    for i in range(args.count):
        batch = next(it)
        batch = {k: v for k, v in batch.items() if k != "example_id"}
        g = grad(params, batch, feed.emb, feed.tokens)
        for name in groups:
            flat = np.concatenate(
                [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(g[name])]
            )
            total[name] = flat if total[name] is None else total[name] + flat
            sq[name] += float(flat @ flat)
        done = i + 1
        eta = (time.time() - t0) / done * (args.count - done)
        print(f"gradient {done}/{args.count} ({args.micro} sentences) | ETA {eta:.0f}s", flush=True)
    feed.close()
    big = args.micro * args.count
    figures = {"micro": args.micro, "count": args.count, "examples": big, "networks": {}}
    for name in groups:
        mean = total[name] / args.count
        figures["networks"][name] = noise_scale(
            sq[name] / args.count, float(mean @ mean), args.micro, big
        )
    print(
        f"{'network':<18} {'|G|^2':>11} {'tr(S)':>11} {'B_noise':>10} "
        f"{'signal@' + str(args.micro):>10} {'signal@512':>10}"
    )
    for name, f in figures["networks"].items():
        ns = f"{f['noise_scale']:.0f}" if f["grad_sq"] > 0 else f"> {big}"
        print(
            f"{name:<18} {f['grad_sq']:>11.3e} {f['trace']:>11.3e} {ns:>10} "
            f"{f[f'signal_share_at_{args.micro}']:>10.3f} {f['signal_share_at_512']:>10.3f}"
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(figures, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
