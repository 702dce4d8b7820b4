"""benchmarks/gpu_check.py, the GPU run of issue 33, runs here on CPU (`--device cpu --quick`): the
same sections (runner timings, invariance, engine greedy identity and tok/s of target-only,
draft>target and the router, transformers' generate as the peer), JSON with the device's name."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # over ~30 s on a 2-core CI machine: `make test-slow`
def test_gpu_check_runs_on_cpu_and_reports(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "SPECROUTER_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert out.is_file(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["errors"] == {}, report["errors"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["device_type"] == "cpu" and report["device"]
    assert set(report["runner"]["eager"]) == {"1x1", "1x5", "1x17", "4x1", "4x5", "4x17"}
    eng = report["engine"]
    assert set(eng) == {"target-only", "draft>target k=4", "router"}
    assert all(v["identical_to_target_only"] for v in eng.values())
    assert eng["draft>target k=4"]["target_acceptance"] > 0.5  # the controlled pair accepts
    assert report["hf_generate"]["tokens"] == eng["target-only"]["tokens"]
    assert report["summary"]["greedy_identical_every_chain"] is True
    assert all(g["met"] is None for g in report["goals"].values())  # no GPU goal is called met on a CPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")
def test_gpu_check_on_the_gpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--quick", "--out", str(out)],
                   check=True, timeout=600)
    report = json.loads(out.read_text())
    assert report["errors"] == {} and report["device_type"] == "cuda"
    assert report["invariance"]["graphed"]["all_bitwise"] and report["graphed_vs_eager"]["bitwise"]
    assert report["summary"]["greedy_identical_every_chain"] is True
