"""kvgen/engine/delivery.py: calls from the engine thread to callers' event loops, a step's at once."""

from __future__ import annotations

import asyncio
import threading

from kvgen.engine import delivery


class CountingLoop:
    """An event loop's call_soon_threadsafe, counted (each is a wake-up of the real loop)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.sends = 0
        real = self.loop.call_soon_threadsafe

        def send(fn, *args):
            self.sends += 1
            return real(fn, *args)

        self.loop.call_soon_threadsafe = send

    def drain(self):
        self.loop.run_until_complete(asyncio.sleep(0))


def test_a_steps_calls_reach_each_loop_in_order_with_one_wake_up():
    a, b = CountingLoop(), CountingLoop()
    got = []

    def engine_step():
        with delivery.batched_delivery():
            for i in range(5):
                delivery.call(a.loop, got.append, ("a", i))
                delivery.call(b.loop, got.append, ("b", i))
            assert a.sends == b.sends == 0  # held until the step ends

    t = threading.Thread(target=engine_step)
    t.start()
    t.join()
    assert (a.sends, b.sends) == (1, 1)
    a.drain()
    b.drain()
    assert [x for x in got if x[0] == "a"] == [("a", i) for i in range(5)]
    assert [x for x in got if x[0] == "b"] == [("b", i) for i in range(5)]
    a.loop.close()
    b.loop.close()


def test_outside_a_step_a_call_goes_at_once_and_a_closed_loop_is_ignored():
    a = CountingLoop()
    got = []
    delivery.call(a.loop, got.append, 1)
    assert a.sends == 1
    a.drain()
    assert got == [1]
    a.loop.close()
    delivery.call(a.loop, got.append, 2)  # nobody listens any more: no error
    with delivery.batched_delivery():
        delivery.call(a.loop, got.append, 3)
    assert got == [1]


def test_one_failing_call_does_not_hold_back_the_others(caplog):
    a = CountingLoop()
    got = []
    with delivery.batched_delivery():
        delivery.call(a.loop, got.append, 1)
        delivery.call(a.loop, lambda: 1 / 0)
        delivery.call(a.loop, got.append, 2)
    a.drain()
    assert got == [1, 2]
    assert "delivering an engine event failed" in caplog.text
    a.loop.close()
