"""Cancels seen before a request reaches the engine (issue #8's review: a cancel while a
decode worker waited for room or pulled was ignored)."""

from __future__ import annotations

from kvmesh.worker.in_flight import InFlight


def test_a_cancel_marks_a_request_in_flight_until_it_is_done():
    flights = InFlight()
    flights.start("a")
    assert not flights.is_cancelled("a")
    flights.cancel("a")
    assert flights.is_cancelled("a")
    flights.done("a")
    assert not flights.is_cancelled("a") and flights.active == set()


def test_a_cancel_that_overtakes_its_work_is_remembered_boundedly():
    flights = InFlight(remember=2)
    for request_id in ("x", "y", "z"):  # cancels of requests not arrived yet
        flights.cancel(request_id)
    flights.start("x")  # forgotten: the oldest of three with room for two
    flights.start("z")
    assert (flights.is_cancelled("x"), flights.is_cancelled("z")) == (False, True)
    flights.done("z")
    flights.start("z")  # a cancel is used once
    assert not flights.is_cancelled("z")
