"""How noisy is REALM's gradient on the retriever? The gradient noise scale -> stdout / JSON.

    python experiments/gradient_noise/gradient_noise.py --config configs/realm.py:squad \
        --workdir SCRATCH [--micro 16] [--count 32] [--out FILE.json] [--config.a.b=value ...]

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
resolve): it is reported as such, and B_noise as "> the examples used". The delete-one
jackknife over the `count` gradients gives each figure a standard error (the gradients are
kept in float32 on the host: count x the parameters x 4 bytes).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
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


def jackknife(grads, b: int) -> dict:
    """Delete-one jackknife standard errors of |G|^2, tr(S) and B_noise from the `count`
    micro-batch gradients (rows of `grads`, each over b examples)."""
    import numpy as np

    count = len(grads)
    total = grads.sum(axis=0, dtype=np.float64)
    sq = np.einsum("ij,ij->i", grads, grads, dtype=np.float64)
    dots = grads @ total  # g_i . T
    tt = float(total @ total)
    rows = []
    for i in range(count):  # |T - g_i|^2 = |T|^2 - 2 g_i.T + |g_i|^2
        mean_sq = (tt - 2 * dots[i] + sq[i]) / (count - 1) ** 2
        rows.append(noise_scale((sq.sum() - sq[i]) / (count - 1), mean_sq, b, b * (count - 1)))
    out = {}
    for key in ("grad_sq", "trace", "noise_scale"):
        v = np.array([r[key] for r in rows], np.float64)
        out[key + "_se"] = (
            float(np.sqrt((count - 1) / count * ((v - v.mean()) ** 2).sum()))
            if np.all(np.isfinite(v))
            else float("inf")
        )
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
    from realm_jax.data import datasets, pipeline
    from realm_jax.index.feed import IndexFeed
    from realm_jax.pretrain import step as realm_step
    from realm_jax.pretrain.step_config import StepConfig
    from realm_jax.train.warm_start import params_hook

    config = load_config(args.config, overrides + ["refresh.mode=inprocess"])
    validate(config)
    fs.makedirs(args.workdir)
    mesh = sharding.make_mesh(config.mesh)
    ddir = paths.data_dir(config, args.workdir)
    datasets.check_prepared(config, ddir)
    tokens = datasets.sharded_block_tokens(ddir, mesh, with_titles=False)
    loader = pipeline.train_loader(
        config, ddir, global_batch_size=args.micro, seed=config.data.seed
    )
    model, _, state, _ = realm_step.create_state(
        config, mesh, jax.random.key(config.train.seed), params_hook(config)
    )
    params = state.params
    feed = IndexFeed(config, args.workdir, mesh, model, tokens)
    feed.start(params, 0)
    cfg = StepConfig.from_config(config, feed.num_blocks).without_terms()
    loss = functools.partial(realm_step.realm_loss, model=model, mesh=mesh, cfg=cfg)
    grad = jax.jit(jax.grad(lambda p, batch, e, t: loss(p, batch, e, t)[0]))
    groups = sorted(params)
    kept = {g: [] for g in groups}  # each micro-batch's gradient, float32, on the host
    it = iter(loader)
    t0 = time.time()
    for i in range(args.count):
        batch = next(it)
        batch = {k: v for k, v in batch.items() if k != "example_id"}
        g = grad(params, batch, feed.emb, feed.tokens)
        for name in groups:
            kept[name].append(
                np.concatenate(
                    [np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(g[name])]
                )
            )
        done = i + 1
        eta = (time.time() - t0) / done * (args.count - done)
        print(f"gradient {done}/{args.count} ({args.micro} sentences) | ETA {eta:.0f}s", flush=True)
    feed.close()
    big = args.micro * args.count
    figures = {"micro": args.micro, "count": args.count, "examples": big, "networks": {}}
    for name in groups:
        grads = np.stack(kept.pop(name))
        mean = grads.mean(axis=0, dtype=np.float64)
        sq = float(np.einsum("ij,ij->", grads, grads, dtype=np.float64)) / args.count
        figures["networks"][name] = noise_scale(sq, float(mean @ mean), args.micro, big)
        figures["networks"][name] |= jackknife(grads, args.micro)
        del grads
    print(
        f"{'network':<18} {'|G|^2 (se)':>22} {'tr(S)':>11} {'B_noise (se)':>16} "
        f"{'signal@' + str(args.micro):>10} {'signal@512':>10}"
    )
    for name, f in figures["networks"].items():
        ns = (
            f"{f['noise_scale']:.0f} ({f['noise_scale_se']:.0f})"
            if f["grad_sq"] > 0
            else f"> {big}"
        )
        g2 = f"{f['grad_sq']:.3e} ({f['grad_sq_se']:.1e})"
        print(
            f"{name:<18} {g2:>22} {f['trace']:>11.3e} {ns:>16} "
            f"{f[f'signal_share_at_{args.micro}']:>10.3f} {f['signal_share_at_512']:>10.3f}"
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(figures, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
