"""Benchmark: what each member's own noise costs a cohort node, against the draws alone (issue 33).

One node of the main job's round: 400 one-image members, tanh CNN, K = 1, B = 1 (random images: the
cost does not depend on their values; ``--model lenet5 --steps 10 --images 4`` for the other setting
of bench/cohort.py), one thread, CPU time, the runs alternated after one warm-up each, medians
printed, the Gaussian runs also as a ratio to plain mini-batch GD (batch 32, no clipping, no noise)
over the same images for as many sample-gradients:

- Gaussian (training/cohort.py ``train_cohort`` with ``KeyedStreams``): summed noise (one draw of the
  sum) and per-member noise (M d normals, one chunk-wide draw per tensor); beside them the M d normals
  alone (``torch.randn`` of the same chunks' shapes): the floor of any per-member scheme whose members'
  noises are independent (each member's d normals must be drawn);
- secure aggregation (training/cohort_secure.py): the clean members' training, then ``node_upload``
  (each member's grid integers and Skellam noise from its own single-client stream); beside it the
  2 M d Poisson draws alone at the same rate (the floor: each member's noise is its own two Poisson
  draws per value, so that one member is exactly the single client).

``--before REV``: the same runs for the versions of training/cohort_data.py, secure_sum.py and
cohort_secure.py at git revision REV (e.g. the branch point), the rest of the package current.
No thresholds are asserted here.

Run: .venv/bin/python bench/member_noise.py [--members 400] [--repeats 5] [--model M --steps K --images B] [--before REV]
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from fl_dp_flower.client import member_streams
from fl_dp_flower.training import cohort_data, cohort_secure
from fl_dp_flower.training.cohort import CohortData, default_member_chunk, train_cohort
from fl_dp_flower.training.models import build_model
from fl_dp_flower.training.secure_sum import SumGrid

ROOT = Path(__file__).resolve().parents[1]
CHANGED = ("cohort_data", "secure_sum", "cohort_secure")
SIGMA, STEP, SEED = 0.55, 2.0**-16, 5  # the main job's sigma; its grid step (lambda = 6.5e8)


def load_before(rev: str, into: Path) -> dict[str, ModuleType]:
    """The CHANGED modules at ``rev`` as package ``_p33n_before`` (their imports of one another kept among
    themselves, every other import the current package's)."""
    pkg = into / "_p33n_before"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in CHANGED:
        src = subprocess.run(["git", "show", f"{rev}:fl_dp_flower/training/{name}.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        src = re.sub(r"^from \.(\w+) import", lambda m: f"from {'_p33n_before' if m[1] in CHANGED else 'fl_dp_flower.training'}"
                     f".{m[1]} import", src, flags=re.M)
        (pkg / f"{name}.py").write_text(src)
    sys.path.insert(0, str(into))
    return {name: importlib.import_module(f"_p33n_before.{name}") for name in CHANGED}


def _cpu(fn: Callable[[], object]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def runs(members: int, model_name: str, steps: int, images: int,
         before: dict[str, ModuleType] | None) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(members * images, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (members * images,), generator=gen)
    data = CohortData.of(x, y, [images] * members)
    model = build_model("mnist", model_name)
    shapes = [tuple(p.shape) for p in model.parameters()]
    values = sum(p.numel() for p in model.parameters())
    chunk = default_member_chunk(images, values, False)
    rows, grid = np.arange(members), SumGrid(STEP)
    lam = grid.poisson_rate(SIGMA)
    kw: dict[str, Any] = dict(step_sizes=[2.0 if steps == 1 else 0.1] * steps, clip_norm=1.0, batch_size=images)

    def plain() -> None:
        """Plain mini-batch SGD (batch 32, no clipping, no noise) for as many sample-gradients, same images."""
        net = build_model("mnist", model_name)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(steps):
            for lo in range(0, len(y), 32):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(x[lo:lo + 32]), y[lo:lo + 32]).backward()
                opt.step()

    def gaussian(streams_module: ModuleType, summed: bool) -> Callable[[], object]:
        def run() -> object:
            streams = streams_module.KeyedStreams(SEED, 1, rows)
            return train_cohort(model, data, rows, streams, **kw, sigma=SIGMA,
                                summed_noise=torch.Generator().manual_seed(7) if summed else None)
        return run

    def normals() -> None:
        noise = torch.Generator().manual_seed(7)
        for lo in range(0, members, chunk):
            for shape in shapes:
                torch.randn((min(chunk, members - lo), *shape), generator=noise).sum(0)

    clean = cohort_secure.clean_members(model, data, rows, member_streams(SEED, rows.tolist(), 1)[0], **kw)

    def skellam(module: ModuleType) -> Callable[[], object]:
        return lambda: module.node_upload(clean, member_streams(SEED, rows.tolist(), 1)[1], grid, SIGMA)

    def poissons() -> None:
        rng = np.random.default_rng(SEED)
        for _ in range(members):
            for shape in shapes:
                rng.poisson(lam, size=(2, *shape))

    out: dict[str, Callable[[], object]] = {
        "plain mini-batch GD, batch 32": plain,
        "Gaussian, summed noise": gaussian(cohort_data, True),
        "Gaussian, per-member noise": gaussian(cohort_data, False),
        "the M d normals alone (floor)": normals,
        "secure: clean members' training": lambda: cohort_secure.clean_members(
            model, data, rows, member_streams(SEED, rows.tolist(), 1)[0], **kw),
        "secure: node_upload (grid + Skellam)": skellam(cohort_secure),
        "the 2 M d Poisson draws alone (floor)": poissons}
    if before is not None:
        out["before: Gaussian, per-member noise"] = gaussian(before["cohort_data"], False)
        out["before: secure node_upload"] = skellam(before["cohort_secure"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="cnn-tanh")
    parser.add_argument("--steps", type=int, default=1, help="local steps K")
    parser.add_argument("--images", type=int, default=1, help="images per member (= the batch size B)")
    parser.add_argument("--before", default=None, help="a git revision whose noise modules are timed beside")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # the fixed-seed warning, once per run
    with tempfile.TemporaryDirectory() as tmp:
        before = load_before(args.before, Path(tmp)) if args.before else None
        timed = runs(args.members, args.model, args.steps, args.images, before)
        spent: dict[str, list[float]] = {key: [] for key in timed}
        for rep in range(args.repeats + 1):  # the first pass warms up and is dropped
            for key, fn in timed.items():
                seconds = _cpu(fn)
                if rep:
                    spent[key].append(seconds)
    print(f"one node, {args.members} members x {args.images} images, {args.model}, K {args.steps}, B {args.images} "
          f"(CPU seconds, one thread, median of {args.repeats} alternated runs; x plain: plain GD's time / the run's)")
    plain = statistics.median(spent["plain mini-batch GD, batch 32"])
    for key, v in spent.items():
        ratio = f"  {plain / statistics.median(v):.2f}x plain" if key.endswith("noise") else ""
        print(f"  {key:<44} {statistics.median(v):.4f} s{ratio}")


if __name__ == "__main__":
    main()
