"""runtime/telemetry.py: a wait of the launching thread is its own time, and on CUDA also the compute stream's idle
time it caused, read from a timing event recorded on that stream as the wait begins and one as it ends."""
import time

import pytest

from pstar_fx.runtime.telemetry import HOST_WAITS, PHASES, Telemetry


class FakeEvent:
    """A timing event the stream reached at `at` seconds (None: not yet)."""

    def __init__(self, at):
        self.at = at

    def query(self):
        return self.at is not None

    def elapsed_time(self, other):
        return (other.at - self.at) * 1e3          # ms, as torch.cuda.Event's


@pytest.mark.parametrize("phase", sorted(HOST_WAITS))
def test_a_host_wait_counts_the_threads_time_and_the_streams_idle_time(phase):
    t = Telemetry()
    assert set(HOST_WAITS.values()) <= set(PHASES)
    with t.host_wait(phase):                        # the CPU runtime: no stream to read
        time.sleep(0.01)
    assert t.seconds[phase] >= 0.01 and t.seconds[HOST_WAITS[phase]] == 0.0
    # the stream reached the first event at 1.0 s and the second at 1.25 s: 0.25 s idle; a third wait whose second
    # event the stream has not reached yet is counted once it has
    marks = iter([FakeEvent(1.0), FakeEvent(1.25), FakeEvent(2.0), late := FakeEvent(None)])
    t.mark = lambda: next(marks)
    for _ in range(2):
        with t.host_wait(phase):
            pass
    t.count_stalls()
    assert t.seconds[HOST_WAITS[phase]] == pytest.approx(0.25)
    late.at = 2.5
    t.steps = 1
    assert t.per_step()[HOST_WAITS[phase]] == pytest.approx(0.75)
    assert t.seconds["compute_waits_for_copies"] == 0.0


def test_a_failed_wait_is_still_counted():
    t = Telemetry()
    marks = iter([FakeEvent(0.0), FakeEvent(0.5)])
    t.mark = lambda: next(marks)
    with pytest.raises(RuntimeError):
        with t.host_wait("wait_for_host_adam"):
            raise RuntimeError("the host Adam failed")
    t.count_stalls()
    assert t.seconds["gpu_idle_for_host_adam"] == pytest.approx(0.5) and t.seconds["wait_for_host_adam"] > 0
