"""The device option through the stack (issue 33): PoolConfig.device, `SpecRouter.from_pretrained(
device=...)`, `--device` on every command that loads a pool, `auto` on a machine without CUDA,
and `cuda` without CUDA a clear DeviceError at load (before any weights are read), never a crash
in the middle of a request. Cost profiles are keyed by device."""

import os

import pytest
import torch

from specrouter import SpecRouter
from specrouter.cli.main import build_parser, main
from specrouter.config import PoolConfig
from specrouter.errors import DeviceError
from specrouter.models.device import device_label, resolve_device
from specrouter.models.pool import Pool
from specrouter.router.profile import ModelIdentity, identity_of

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour where torch sees no CUDA GPU")


def test_device_names_are_validated():
    for ok in ("auto", "cpu", "cuda", "cuda:1"):
        assert PoolConfig(device=ok).device == ok
    for bad in ("gpu", "CUDA", "cuda:", "cuda:x", "", "mps"):
        with pytest.raises(ValueError, match="device must be"):
            PoolConfig(device=bad)
    with pytest.raises(DeviceError, match="device must be"):
        resolve_device("tpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert device_label("cpu") == "cpu"


@no_cuda
def test_auto_is_the_cpu_and_cuda_is_a_clear_error_without_cuda():
    assert resolve_device("auto") == torch.device("cpu")
    for name in ("cuda", "cuda:0"):
        with pytest.raises(DeviceError, match=f"device '{name}' asked for, but .*use --device cpu"):
            resolve_device(name)


@no_cuda
def test_cuda_without_cuda_fails_at_load_before_weights(tiny_pool_dirs, monkeypatch):
    d = tiny_pool_dirs
    read = []
    import specrouter.models.runners.llama as llama

    monkeypatch.setattr(llama, "read_checkpoint", lambda *a, **k: read.append(a) or 1 / 0)
    with pytest.raises(DeviceError, match="use --device cpu"):
        SpecRouter.from_pretrained([str(d["draft"]), str(d["target"])], device="cuda", adaptive=False)
    with pytest.raises(DeviceError):
        Pool.load([str(d["target"])], device="cuda:0")
    assert read == []  # no weights were read


def test_pool_on_cpu_by_auto_and_by_name(tiny_pool_dirs):
    d = tiny_pool_dirs
    for device in ("auto", "cpu") if not torch.cuda.is_available() else ("cpu",):
        sr = SpecRouter.from_pretrained([str(d["draft"]), str(d["target"])], dtype="float64",
                                        device=device, adaptive=False, ngram=False, suffix=False)
        assert sr.pool.device == torch.device("cpu")
        assert all(r.device == torch.device("cpu") for r in sr.pool.runners.values())
        out = sr.generate("ab", max_new_tokens=4)[0]
        assert len(out.token_ids) == 4


def test_every_pool_command_has_device():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for cmd in ("generate", "chat", "serve", "bench", "profile"):
        flags = {s for a in sub.choices[cmd]._actions for s in a.option_strings}
        assert "--device" in flags, cmd


@no_cuda
def test_cli_device_cuda_is_one_line_error(tiny_pool_dirs, monkeypatch, capsys):
    d = tiny_pool_dirs
    monkeypatch.setenv("SPECROUTER_DEFAULT_POOL", os.pathsep.join(["ngram", str(d["random"]), str(d["target"])]))
    assert main(["generate", "--prompt", "x", "--max-new-tokens", "2", "--static", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "device 'cuda' asked for" in err and "Traceback" not in err
    assert err.strip().count("\n") == 0, err
    assert main(["generate", "--prompt", "x", "--device", "gpu"]) == 2  # PoolConfig refuses it
    assert "device must be" in capsys.readouterr().err


def test_ray_replicas_with_gpus_load_on_cuda():
    from specrouter.cli.serve import ray_configs

    parser = build_parser()
    args = parser.parse_args(["serve", "--ray", "--ray-num-gpus", "1"])
    spec, _ = ray_configs(args)
    assert spec.device == "cuda"  # auto becomes cuda: a replica without a usable GPU fails at load
    args = parser.parse_args(["serve", "--ray", "--ray-num-gpus", "1", "--device", "cpu"])
    with pytest.raises(ValueError, match="--device cpu"):
        ray_configs(args)
    assert ray_configs(parser.parse_args(["serve", "--ray"]))[0].device == "auto"


def test_cost_profiles_are_keyed_by_device(tiny_pool_dirs):
    cpu = ModelIdentity("t", 10, "float32")
    gpu = ModelIdentity("t", 10, "float32", "cuda:NVIDIA H200")
    assert cpu.key() == "t|10|float32"  # profiles saved before devices existed stay valid on CPU
    assert gpu.key() != cpu.key()
    runner = Pool.load([str(tiny_pool_dirs["target"])], dtype="float64", ngram=False, suffix=False).runners["target"]
    assert identity_of(runner).device == "cpu"
