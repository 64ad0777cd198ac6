"""Devices and their array modules.

The probe order for `device="auto"` is metal, cuda, cpu. The model code is
written against NumPy today; the CuPy (CUDA) and MLX (Metal) array paths are
their own piece of work, so until they land an explicit request for them
raises `DeviceUnavailableError` instead of silently running on the CPU.
"""

from __future__ import annotations

import importlib.util
import platform

DEVICES = ("metal", "cuda", "cpu")
IMPLEMENTED = ("cpu",)


class DeviceUnavailableError(RuntimeError):
    """The requested device is absent, or the engine cannot run on it yet."""


def available_devices() -> list[str]:
    """Devices present on this machine, in probe order (cpu is always last)."""
    found = []
    if platform.system() == "Darwin" and importlib.util.find_spec("mlx") is not None:
        found.append("metal")
    if importlib.util.find_spec("cupy") is not None:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                found.append("cuda")
        except Exception:  # driver missing or broken: not usable
            pass
    found.append("cpu")
    return found


def resolve_device(device: str = "auto") -> str:
    """Turn "auto" or an explicit device name into the device the engine will use."""
    if device == "auto":
        return next(d for d in available_devices() if d in IMPLEMENTED)
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of auto, {', '.join(DEVICES)}")
    if device not in available_devices():
        raise DeviceUnavailableError(f"device {device!r} is not available on this machine")
    if device not in IMPLEMENTED:
        raise DeviceUnavailableError(
            f"device {device!r} is present but the engine runs only on {', '.join(IMPLEMENTED)} "
            "so far"
        )
    return device
