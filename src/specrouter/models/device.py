"""Where a pool's models run: the device option of the pool config (`--device`, `device=`).

"auto" is the first CUDA GPU when torch sees one, else the CPU; "cpu"; "cuda" or "cuda:N". A
CUDA device on a machine where torch sees none is a `DeviceError` when the pool loads (before
any weights are read), never a crash in the middle of a request.
"""

from __future__ import annotations

import re

import torch

from specrouter.config import DEVICE_PATTERN
from specrouter.errors import DeviceError


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """The torch device `name` stands for here ("auto" resolved); raises DeviceError for a
    CUDA device torch cannot use on this machine."""
    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str) or not re.match(DEVICE_PATTERN, name):
        raise DeviceError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA support" if torch.version.cuda is None
                   else "torch sees no CUDA GPU (driver, CUDA_VISIBLE_DEVICES?)")
            raise DeviceError(f"device {name!r} asked for, but {why} (torch {torch.__version__}); "
                              "use --device cpu (or auto)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(f"device {name!r} asked for, but torch sees {count} CUDA GPU(s)")
    return device


def device_label(device: torch.device | str) -> str:
    """A device as the cost profile keys it: "cpu", or "cuda:<GPU name>" (a profile measured on
    one kind of device is never reused on another)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (timings of asynchronous devices); a no-op on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
