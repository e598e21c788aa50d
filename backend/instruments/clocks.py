"""The clocks a StepTimer reads: host timers on CPU, device events on accelerators.

time.perf_counter on CPU; device events (torch.<device>.Event(enable_timing=True), recorded
on the current stream) on accelerators, resolved when waited for: host-side timestamps would
measure kernel launches, not execution. Every clock has mark() / seconds(start, end) /
wait(mark).
"""

import time

import torch


class _HostClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def wait(self, mark) -> None:
        pass


class _DeviceClock:
    """Events on the current stream of `device` (torch.cuda.Event, torch.npu.Event, ...)."""

    def __init__(self, device: torch.device):
        self.event_type = torch.get_device_module(device).Event

    def mark(self):
        event = self.event_type(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds

    def wait(self, mark) -> None:
        mark.synchronize()


def make_clock(device: str | torch.device):
    device = torch.device(device)
    return _HostClock() if device.type == "cpu" else _DeviceClock(device)
