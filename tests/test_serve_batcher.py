"""vitkit.serve.batcher alone: batches close when full or max_delay after their first item arrived, the queue
refuses at once when full, and a caller that stops waiting disturbs neither its batch nor the next."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("starlette", reason="vitkit serve needs the serve extra: pip install 'vitkit[serve]'")

from vitkit.serve.batcher import Batcher, Closed, QueueFull, TooMany  # noqa: E402


class Recorder:
    """A `run` that doubles each item after `seconds`, and records each batch and when it started."""

    def __init__(self, seconds: float = 0.0):
        self.seconds, self.batches, self.starts = seconds, [], []

    async def __call__(self, items):
        self.batches.append(list(items))
        self.starts.append(asyncio.get_running_loop().time())
        await asyncio.sleep(self.seconds)
        return [2 * i for i in items]


def run(coro):
    return asyncio.run(coro)


def test_items_arriving_together_run_as_one_batch():
    async def main():
        rec = Recorder()
        b = Batcher(rec, max_batch_size=8, max_delay=0.05)
        b.start()
        results = await asyncio.gather(*(b.submit(i) for i in range(5)))
        await b.close()
        return rec, results

    rec, results = run(main())
    assert results == [0, 2, 4, 6, 8]
    assert rec.batches == [[0, 1, 2, 3, 4]]


def test_a_full_batch_runs_at_once_and_the_rest_wait_for_the_next():
    async def main():
        rec = Recorder()
        b = Batcher(rec, max_batch_size=4, max_delay=10.0)  # only fullness can close a batch in time
        b.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first = await asyncio.wait_for(asyncio.gather(*(b.submit(i) for i in range(4))), 1.0)
        elapsed = loop.time() - t0
        await b.close()
        return rec, first, elapsed

    rec, first, elapsed = run(main())
    assert first == [0, 2, 4, 6] and rec.batches == [[0, 1, 2, 3]]
    assert elapsed < 0.5


def test_a_batch_waits_at_most_max_delay_after_its_first_item_arrived():
    async def main():
        rec = Recorder()
        b = Batcher(rec, max_batch_size=16, max_delay=0.2)
        b.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.sleep(0.15)
        second = asyncio.ensure_future(b.submit(2))  # joins the batch that the first one opened
        await asyncio.gather(first, second)
        await b.close()
        return rec, rec.starts[0] - t0

    rec, started_after = run(main())
    assert rec.batches == [[1, 2]]
    assert 0.19 <= started_after < 0.33, started_after  # 0.2 s after the first, not 0.2 s after the second


def test_a_batch_closes_once_every_item_on_its_way_is_in_it():
    """`all_here` says nothing more is on its way (the server: every request it is answering is queued): the
    batch runs then, not max_delay later; while it says otherwise, the batch waits for the others."""
    async def main():
        rec = Recorder()
        coming = {"n": 1}
        b = Batcher(rec, max_batch_size=16, max_delay=5.0, all_here=lambda: b.depth >= coming["n"])
        b.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(b.submit(1), 1.0)  # alone: at once, not 5 s later
        alone = loop.time() - t0
        coming["n"] = 3
        first = asyncio.ensure_future(b.submit(2))
        await asyncio.sleep(0.2)
        assert len(rec.batches) == 1  # waits: two more are on their way
        await asyncio.wait_for(asyncio.gather(first, b.submit(3), b.submit(4)), 1.0)
        await b.close()
        return rec, alone

    rec, alone = run(main())
    assert alone < 0.5 and rec.batches == [[1], [2, 3, 4]]


def test_items_that_waited_behind_a_running_batch_start_at_once():
    """The delay counts from an item's arrival, not from when the worker is free to look at it."""
    async def main():
        rec = Recorder(seconds=0.6)
        b = Batcher(rec, max_batch_size=16, max_delay=0.3)
        b.start()
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.sleep(0.45)  # the first batch is running now, until 0.9 s
        later = [asyncio.ensure_future(b.submit(i)) for i in (2, 3)]  # their delay ends at 0.75 s
        await asyncio.gather(first, *later)
        await b.close()
        return rec

    rec = run(main())
    assert rec.batches == [[1], [2, 3]]
    gap = rec.starts[1] - rec.starts[0]
    assert gap < 0.6 + 0.15, gap  # ran as soon as the first batch ended, with no fresh 0.3 s wait


def test_a_full_queue_refuses_at_once():
    async def main():
        rec = Recorder(seconds=0.2)
        b = Batcher(rec, max_batch_size=1, max_delay=0.0, queue_size=2)
        b.start()
        running = asyncio.ensure_future(b.submit(0))
        await asyncio.sleep(0.05)  # the worker took it: the queue is empty again
        queued = [asyncio.ensure_future(b.submit(i)) for i in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="at most 2"):
            await b.submit(3)
        with pytest.raises(QueueFull):
            await b.submit_many([4, 5])
        with pytest.raises(TooMany, match="3 items in one request, and the queue holds at most 2"):
            await b.submit_many([4, 5, 6])
        results = await asyncio.gather(running, *queued)
        await b.close()
        return results

    assert run(main()) == [0, 2, 4]


def test_a_caller_that_stops_waiting_breaks_neither_its_batch_nor_the_next():
    async def main():
        rec = Recorder(seconds=0.1)
        b = Batcher(rec, max_batch_size=4, max_delay=0.05)
        b.start()
        impatient = asyncio.ensure_future(asyncio.wait_for(b.submit(1), 0.08))  # gives up while it runs
        patient = asyncio.ensure_future(b.submit(2))
        with pytest.raises(asyncio.TimeoutError):
            await impatient
        assert await patient == 4
        queued_then_gone = asyncio.ensure_future(b.submit(3))
        await asyncio.sleep(0.01)
        queued_then_gone.cancel()  # leaves while queued: skipped, not run
        after = await asyncio.wait_for(b.submit(5), 1.0)
        await b.close()
        return rec, after

    rec, after = run(main())
    assert after == 10
    assert [sorted(batch) for batch in rec.batches] == [[1, 2], [5]]


def test_an_error_in_run_fails_its_batch_only():
    async def main():
        calls = []

        async def flaky(items):
            calls.append(items)
            if len(calls) == 1:
                raise RuntimeError("the model failed")
            return items

        b = Batcher(flaky, max_batch_size=4, max_delay=0.02)
        b.start()
        with pytest.raises(RuntimeError, match="the model failed"):
            await b.submit(1)
        ok = await b.submit(2)
        await b.close()
        with pytest.raises(Closed):
            await b.submit(3)
        return ok

    assert run(main()) == 2


@pytest.mark.parametrize("kwargs, message", [({"max_batch_size": 0}, "max_batch_size=0"),
                                             ({"max_delay": -1}, "max_delay=-1"),
                                             ({"queue_size": 0}, "queue_size=0")])
def test_settings_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Batcher(Recorder(), **kwargs)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_deadline_closes_the_batch_on_any_event_loop(loop):
    """The deadline's timer alone closes a batch that `all_here` keeps open. uvloop (uvicorn's loop where it
    is installed) keeps time in whole milliseconds: its timer may run when loop.time() still reads a hair
    before the deadline, so a batcher that compared the clock again after the timer went back to waiting,
    with no timer left, until the next submission."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop", reason="uvloop is uvicorn's loop where it is installed")
        runner = uvloop.run
    else:
        runner = asyncio.run

    async def main():
        # 10 ms: arrival + 0.010 is a hair above the millisecond the timer fires at for about a quarter of the
        # arrival times (float rounding), 1 ms never
        b = Batcher(Recorder(), max_batch_size=16, max_delay=0.010, all_here=lambda: False)
        b.start()
        try:
            for i in range(60):
                assert await asyncio.wait_for(b.submit(i), 1.0) == 2 * i
                await asyncio.sleep(0.0003 * (i % 7))
        finally:
            await b.close()

    runner(main())
