"""bench/gpu.py --quick runs on the CPU and prints every figure (the GPU session runs it in full)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"


def test_gpu_bench_quick_prints_every_figure(capsys):
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--quick", "--members", "40,120"])
    out = capsys.readouterr().out
    assert re.search(r"plain SGD.*batch 64: [\d,]+ samples/s", out)
    for noise in ("summed", "per-member"):
        for m in ("40", "120"):
            assert re.search(rf"cohort, +{m} one-image clients, K 1, {noise} noise: +[\d.]+ s per round.*x plain.*"
                             r"peak memory [\d,]+ MiB", out), out
    assert len(re.findall(r"host work of one round, \d+ members in \d+ chunks of 20: \{'aten calls': \d+", out)) == 2
    assert re.search(r"host work per additional chunk of 20 members: \{'aten calls': [\d.]+", out)
    assert re.search(r"main job preset, 40 clients, 2 rounds on LocalGrid.*final accuracy [\d.]+", out)
