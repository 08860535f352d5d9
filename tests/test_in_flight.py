"""InFlight: the overlapped loop's launched batches, taken in launch order."""

from pdserve.common.engine.in_flight import InFlight


def test_take_before_yields_in_launch_order_and_stops_at_the_batch():
    q = InFlight()
    a, b, c = object(), object(), object()
    q.push(a, "ra")
    q.push(b, "rb")
    q.push(c, "rc")
    assert q.last_batch() is c and len(q) == 3
    assert list(q.take_before(c)) == [(a, "ra"), (b, "rb")]
    assert q.oldest() == (c, "rc")
    assert list(q.take_before(None)) == [(c, "rc")]
    assert not q and q.oldest() is None and q.last_batch() is None


def test_an_entry_is_removed_only_as_it_is_taken():
    # process_batch_result looks at oldest() (a deferred sampling waiting on its tokens) while
    # it processes the entry just taken: that must already be the next one.
    q = InFlight()
    a, b = object(), object()
    q.push(a, "ra")
    q.push(b, "rb")
    seen = [(batch, q.oldest()) for batch, _ in q.take_before(None)]
    assert seen == [(a, (b, "rb")), (b, None)]


def test_map_results_swaps_results_in_place():
    q = InFlight()
    a, b = object(), object()
    q.push(a, 1)
    q.push(b, 2)
    q.map_results(lambda batch, result: result * 10 if batch is b else result)
    assert list(q.take_before(None)) == [(a, 1), (b, 20)]
