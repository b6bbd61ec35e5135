"""The NVML path of the utilisation meter, with a stand-in `pynvml` module: the right GPU is
asked (CUDA_VISIBLE_DEVICES by index or UUID), and the value is the mean of what NVML said."""
import threading
import types

import pytest

from pipeline.cluster.utilization import UtilizationMeter


class FakeNVML(types.ModuleType):
    """pynvml's four calls the meter uses; utilisation readings come from `readings`, and
    `enough` is set once `need` readings were taken."""

    def __init__(self, readings, need=3, broken=False):
        super().__init__("pynvml")
        self.readings, self.need, self.broken = list(readings), need, broken
        self.given: list[int] = []
        self.handles: list[tuple[str, object]] = []
        self.enough = threading.Event()

    def nvmlInit(self):
        if self.broken:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, index):
        self.handles.append(("index", index))
        return ("handle", index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.handles.append(("uuid", uuid))
        return ("handle", uuid)

    def nvmlDeviceGetUtilizationRates(self, handle):
        gpu = self.readings[len(self.given) % len(self.readings)]
        self.given.append(gpu)
        if len(self.given) >= self.need:
            self.enough.set()
        return types.SimpleNamespace(gpu=gpu, memory=0)


def measure(monkeypatch, fake, device, visible=None):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with UtilizationMeter(device, interval=0.001) as meter:
        if not fake.broken:
            assert fake.enough.wait(30), "the meter's thread never sampled NVML"
    return meter


@pytest.mark.parametrize("device,visible,handle", [
    ("cuda", None, ("index", 0)),
    ("cuda:1", None, ("index", 1)),
    ("cuda:1", "3,5", ("index", 5)),                       # torch's cuda:1 is physical GPU 5
    ("cuda:0", "GPU-1a2b,GPU-3c4d", ("uuid", "GPU-1a2b")),
])
def test_the_mean_of_nvml_readings_of_the_right_gpu(monkeypatch, device, visible, handle):
    fake = FakeNVML([20, 90, 40, 70])
    meter = measure(monkeypatch, fake, device, visible)
    assert fake.handles == [handle]
    assert len(fake.given) >= 3
    assert meter.value == pytest.approx(sum(fake.given) / len(fake.given) / 100.0)
    assert 0.2 <= meter.value <= 0.9


def test_no_nvml_gives_none(monkeypatch):
    fake = FakeNVML([50], broken=True)
    meter = measure(monkeypatch, fake, "cuda:0")
    assert meter.value is None and fake.given == []
