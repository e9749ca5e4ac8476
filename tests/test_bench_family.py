"""The vLLM trace family's draws (bench/vllm_family.py): seeded, and laps that
lengthen a trace without changing what it is made of."""

from __future__ import annotations

import dataclasses

import pytest

from bench.vllm_family import FAMILY, PROBES, SIZES, Shape, Trace, draw


def images(trace: Trace) -> list[tuple[int, tuple[int, int]]]:
    return [image for turns in trace.chats for turn in turns for image in turn]


@pytest.mark.parametrize("shape", FAMILY, ids=lambda s: s.name)
def test_a_seed_draws_one_trace_whose_first_lap_is_the_one_lap_trace(shape: Shape) -> None:
    assert draw(shape, 7).chats == draw(shape, 7).chats
    assert draw(shape, 7).chats != draw(shape, 8).chats
    one_lap = draw(dataclasses.replace(shape, laps=1), 7)
    assert draw(shape, 7).chats[: len(one_lap.chats)] == one_lap.chats


def test_laps_keep_the_sizes_bring_new_images_and_probe_once() -> None:
    shape = Shape("t", tuple(SIZES), "probe-first", "zipf", True, laps=3)
    trace = draw(shape, 5)
    one = draw(dataclasses.replace(shape, laps=1), 5)
    first = len(one.chats)
    later = Trace("t", 5, trace.chats[first:])
    # New images in every later lap, of the sizes the first lap drew from.
    assert not {seed for seed, _ in images(one)} & {seed for seed, _ in images(later)}
    assert {size for _, size in images(later)} <= {size for _, size in images(one)}
    # The probes (the seeds past 990 of a lap's thousand) come first, once.
    probes = [seed for seed, _ in images(trace) if seed % 1000 >= 990]
    assert len(probes) == PROBES
    assert [turns[0][0][0] for turns in trace.chats[:PROBES]] == probes
    assert trace.requests > 2 * one.requests and trace.unique > 2 * one.unique


def test_each_once_sends_every_image_once_in_chats_of_one_turn() -> None:
    (shape,) = [s for s in FAMILY if s.once]
    trace = draw(shape, 3)
    assert all(len(turns) == 1 for turns in trace.chats)
    assert all(1 <= len(turns[0]) <= 4 for turns in trace.chats)
    assert len(images(trace)) == trace.unique  # no image twice
    assert trace.requests == shape.chats * shape.laps
