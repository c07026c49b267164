"""The simulated engine's device KV cache: a tensor ``[gpu_blocks, row_elems]`` of int64 the
"model" writes block values into and a load is checked against.

:class:`SimDevice` is the role (``tensor``, ``backend``, ``write_rows``, ``read_rows``); the
numpy device needs no torch, the torch device runs on CPU or CUDA. :func:`make_device` picks
one (torch when importable unless told otherwise).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

__all__ = ["NumpyDevice", "SimDevice", "TorchDevice", "make_device"]


class SimDevice(ABC):
    #: the tensor the transfer worker copies from and into
    tensor: Any
    #: ``"numpy"`` or ``"torch-<device type>"``
    backend: str

    @abstractmethod
    def write_rows(self, rows: list[int], vals: list[int]) -> None:
        """Set every element of row ``rows[i]`` to ``vals[i]``."""

    @abstractmethod
    def read_rows(self, rows: list[int]) -> np.ndarray:
        """Rows ``rows`` as a numpy array (a copy)."""


class NumpyDevice(SimDevice):
    backend = "numpy"

    def __init__(self, num_blocks: int, row_elems: int) -> None:
        self.tensor = np.zeros((num_blocks, row_elems), dtype=np.int64)

    def write_rows(self, rows: list[int], vals: list[int]) -> None:
        self.tensor[np.asarray(rows)] = np.asarray(vals, dtype=np.int64)[:, None]

    def read_rows(self, rows: list[int]) -> np.ndarray:
        return self.tensor[np.asarray(rows, dtype=np.int64)]


class TorchDevice(SimDevice):
    def __init__(self, num_blocks: int, row_elems: int, device: str = "cpu") -> None:
        import torch

        self._torch = torch
        self.tensor = torch.zeros((num_blocks, row_elems), dtype=torch.int64, device=device)
        self.backend = "torch-" + self.tensor.device.type

    def write_rows(self, rows: list[int], vals: list[int]) -> None:
        torch, dev = self._torch, self.tensor.device
        self.tensor[torch.as_tensor(rows, device=dev)] = torch.as_tensor(vals, dtype=torch.int64, device=dev).unsqueeze(1)

    def read_rows(self, rows: list[int]) -> np.ndarray:
        return self.tensor[self._torch.as_tensor(rows, device=self.tensor.device)].cpu().numpy()


def make_device(num_blocks: int, row_elems: int, use_torch: bool | None = None, device: str = "cpu") -> SimDevice:
    """A torch device when ``use_torch`` (ImportError without torch) or when None and torch
    imports; else numpy (CPU only: another ``device`` is a ValueError)."""
    if use_torch is not False:
        try:
            return TorchDevice(num_blocks, row_elems, device)
        except ImportError:
            if use_torch:
                raise
    if device != "cpu":
        raise ValueError(f"device {device!r} needs torch; the numpy backend runs on the CPU only")
    return NumpyDevice(num_blocks, row_elems)
