"""How busy the device was while a block ran, as a share in 0..1.

On CUDA: the mean of NVML's GPU utilisation (percent of time a kernel was running), sampled
in a background thread every `interval` seconds. On CPU: the process's CPU time over wall
time times the threads torch uses (1.0 = every thread busy throughout). None when it cannot
be measured (no NVML library or driver).
"""
from __future__ import annotations

import os
import threading
import time


def cpu_share(cpu_s: float, wall_s: float, threads: int) -> float | None:
    if wall_s <= 0 or threads <= 0:
        return None
    return min(1.0, cpu_s / (wall_s * threads))


def _nvml_handle(device: str):
    """NVML handle of the GPU behind torch's `device` (CUDA_VISIBLE_DEVICES-aware), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = int(device.split(":")[1]) if ":" in device else 0
        visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if visible:
            ident = visible[index].strip()
            if not ident.isdigit():
                return pynvml.nvmlDeviceGetHandleByUUID(ident)
            index = int(ident)
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # no library, no driver, odd device string: not measurable
        return None


class UtilizationMeter:
    """`with UtilizationMeter(device, threads) as m: ...` then `m.value`."""

    def __init__(self, device: str, threads: int = 1, interval: float = 0.05) -> None:
        self.device, self.threads, self.interval = str(device), max(1, threads), interval
        self.value: float | None = None
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "UtilizationMeter":
        self._cpu0, self._wall0 = time.process_time(), time.perf_counter()
        if self.device.startswith("cuda"):
            handle = _nvml_handle(self.device)
            if handle is not None:
                self._thread = threading.Thread(target=self._sample, args=(handle,), daemon=True)
                self._thread.start()
        return self

    def _sample(self, handle) -> None:
        import pynvml

        while not self._stop.is_set():
            try:
                self._samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
            except Exception:
                return
            self._stop.wait(self.interval)

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._wall0
        if self.device.startswith("cuda"):
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            self.value = sum(self._samples) / len(self._samples) if self._samples else None
        else:
            self.value = cpu_share(time.process_time() - self._cpu0, wall, self.threads)
