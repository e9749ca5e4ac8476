"""A family of traces nobody tuned the plugin to: vLLM alone beside vLLM with mmcache.

    .venv-vllm/bin/python -m bench.vllm_family [--short] [--seed N]
        [--api-servers 1,2,4] [--data-parallel] [--repeats 3]

Each trace is drawn from its seed and printed (its image sizes and every
request's images) before it runs. The family crosses:

- image sizes mixed: 64x64 icons, 448x448, 1024x1024 and 1920x1080, in
  several mixes and orders (small first among them: the order that locked
  the old upload admission out, issue 42);
- popularity: Zipf (s = 1.1) and uniform over the pool;
- an all-distinct phase (every image new) followed by repeats, whose
  popularity is reversed (the later images become the popular ones);
- multi-turn chats of 1-6 turns, each turn re-sending the chat's earlier
  images (the last 4), four chats at a time; and icons each sent once
  (single-turn chats of 1-4 new 64x64 images: sharing's worst case);
- the edges: sizes either side of the plugin's small-image bound (200x200
  to 320x240), thumbnails before HD that comes back, a pair of images one of
  which is 2560x1440 (an 87 MB item) asked for again and again, and a wide
  pool of mid sizes each seldom asked again;
- laps: a trace whose one draw replays in about a second draws its chats
  again, from the same image sizes but with new images, several times over
  (the probes only first), so its requests/s is measured over seconds.

Per trace and configuration (`--api-server-count` 1, 2, 4; 2 engines with
`--data-parallel-size 2`), vLLM alone and mmcache in turn, a fresh
deployment each round that serves the traces one after the other (`--fresh`:
a deployment per trace): vLLM's hits of its queries, processor runs (queries less
hits) against the trace's unique images, requests/s, API and engine CPU ms
per request (read from /proc: bench/vllm.py), the prompt tokens the
engines found in their prefix caches (`vllm:prefix_cache_hits_total`: what
the engines did not compute again), all the CPU a request cost
(the sidecar's too), and the plugin's uploads made
and declined (`mmcache_vllm_uploaded_items_total`,
`mmcache_vllm_not_uploaded_items_total`). With `--repeats` the median of
the runs is printed, and beside requests/s the least and most of each
round's own ratio (rounds run in turn); after the table, the family's median and worst trace
for each measure. `--short` (in `make bench`): two traces, one and four API
servers, one run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import stop_on_sigterm
from bench.vllm import Deployment, deployment
from tests.vllm.tiny_model import REAL_PIXELS, build

Size = tuple[int, int]
SIZES: dict[str, Size] = {
    "64x64": (64, 64),
    "448x448": (448, 448),
    "1024x1024": (1024, 1024),
    "1920x1080": (1920, 1080),
    # The edges' sizes (the last four traces): either side of the plugin's
    # small-image bound (256x256 pixels; their items all under 1 MiB, in the
    # sidecar's heap), not square, and past the family's largest.
    "200x200": (200, 200),
    "256x256": (256, 256),
    "257x257": (257, 257),
    "320x240": (320, 240),
    "800x600": (800, 600),
    "1280x720": (1280, 720),
    "2560x1440": (2560, 1440),
}
MOST_IMAGES = 4  # a prompt's images (the bench's --limit-mm-per-prompt)


@dataclass(frozen=True)
class Shape:
    """What a trace of the family is made of (its seed draws the rest)."""

    name: str
    mix: tuple[str, ...]  # the sizes drawn from, uniformly
    # "probe-first": 4 requests of one 64x64 image each come first (a
    # readiness probe's, one per API server), then the pool in any order;
    # "large-first": the most popular images are the largest; "shuffled".
    order: str
    popularity: str  # "zipf" or "uniform"
    distinct_first: bool  # an all-distinct phase before the repeats
    pool: int = 8
    chats: int = 8
    # The shape drawn again this many times, each lap with images of its own
    # (the probes only in the first): a trace whose replay would last about
    # a second is replayed for several, so requests/s is measured, not its
    # first requests' luck.
    laps: int = 1
    # Every image new and sent once: chats of one turn of 1-4 new images
    # (sharing's worst case: everything uploaded, nothing to hit).
    once: bool = False


FAMILY = (
    Shape("probe-then-1024-zipf", ("1024x1024",), "probe-first", "zipf", False, laps=2),
    Shape("probe-then-mixed-uniform", tuple(SIZES), "probe-first", "uniform", False),
    Shape("mixed-shuffled-zipf", tuple(SIZES), "shuffled", "zipf", False, laps=2),
    Shape(
        "large-first-uniform",
        ("64x64", "448x448", "1920x1080"),
        "large-first",
        "uniform",
        False,
        laps=6,
    ),
    Shape("distinct-then-repeat-zipf", tuple(SIZES), "probe-first", "zipf", True, laps=4),
    Shape("distinct-then-repeat-uniform", ("64x64", "1920x1080"), "shuffled", "uniform", True),
    # Sharing's worst case: items as cheap to process as to share, new first.
    Shape("icons-distinct-then-repeat", ("64x64",), "shuffled", "zipf", True, laps=4),
    # And at its worst: such items each sent once (appended: the seeds above stay).
    Shape("icons-each-once", ("64x64",), "shuffled", "uniform", True, chats=30, laps=4, once=True),
    # The edges (appended): sizes either side of the small-image bound ...
    Shape(
        "edge-small-zipf",
        ("200x200", "256x256", "257x257", "320x240"),
        "probe-first",
        "zipf",
        False,
        laps=3,
    ),
    # ... thumbnails first, then HD that comes back ...
    Shape(
        "thumbs-then-hd-repeat",
        ("64x64", "320x240", "1280x720"),
        "probe-first",
        "zipf",
        True,
        laps=3,
    ),
    # ... two images, one of 87 MB processed, asked for again and again ...
    Shape("hot-pair-huge", ("2560x1440", "64x64"), "shuffled", "zipf", False, pool=2, laps=2),
    # ... and a wide pool of mid sizes, each seldom asked again.
    Shape(
        "mid-uniform-wide",
        ("800x600", "448x448", "200x200"),
        "shuffled",
        "uniform",
        False,
        pool=24,
        laps=2,
    ),
)
SHORT = ("probe-then-1024-zipf", "distinct-then-repeat-zipf")
PROBES = 4

Image = tuple[int, Size]  # (seed, size)


@dataclass
class Trace:
    name: str
    seed: int
    chats: list[list[list[Image]]]  # per chat, per turn, the images sent

    @property
    def requests(self) -> int:
        return sum(len(turns) for turns in self.chats)

    @property
    def unique(self) -> int:
        return len({image for turns in self.chats for turn in turns for image in turn})

    def describe(self) -> str:
        sizes = {f"{s}": f"{w}x{h}" for turns in self.chats for t in turns for s, (w, h) in t}
        chats = [[[seed for seed, _ in turn] for turn in turns] for turns in self.chats]
        return (
            f"trace {self.name} seed={self.seed} requests={self.requests} "
            f"unique={self.unique} sizes={sizes} chats={chats}"
        )


def draw(shape: Shape, seed: int) -> Trace:
    """A trace of `shape`, the same for the same seed: its laps one after
    the other (the first lap is the trace a one-lap shape of this seed draws)."""
    rng = random.Random(seed)
    sizes = [SIZES[rng.choice(shape.mix)] for _ in range(shape.pool)]
    if shape.order == "large-first":  # popularity ranks: the largest lead
        sizes.sort(key=lambda s: s[0] * s[1], reverse=True)
    chats: list[list[list[Image]]] = []
    for lap in range(shape.laps):
        # Image seeds: distinct per trace and lap, so no deployment saw them;
        # each lap draws its chats anew from the same sizes.
        base = seed * 1000 + lap * 1_000_000
        chats += _lap(shape, rng, sizes, base, probes=lap == 0)
    return Trace(shape.name, seed, chats)


def _lap(
    shape: Shape, rng: random.Random, sizes: list[Size], base: int, probes: bool
) -> list[list[list[Image]]]:
    fresh = iter(range(base + 500, base + 1000))
    if shape.once:  # a chat of one turn each, every image new
        return [
            [[(next(fresh), rng.choice(sizes)) for _ in range(rng.randint(1, MOST_IMAGES))]]
            for _ in range(shape.chats)
        ]
    pool = [(base + n, size) for n, size in enumerate(sizes)]
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(pool))]
    if shape.popularity == "uniform":
        weights = [1.0] * len(pool)
    chats = []
    for chat in range(shape.chats):
        distinct = shape.distinct_first and chat < shape.chats // 2
        # After the distinct phase popularity turns: the last images lead.
        ranked = pool[::-1] if shape.distinct_first else pool
        images: list[Image] = []
        turns = []
        for _ in range(rng.randint(1, 6)):
            if distinct:
                image = (next(fresh), rng.choice(sizes))
            else:
                image = rng.choices(ranked, weights)[0]
            if image not in images:
                images.append(image)
            turns.append(images[-MOST_IMAGES:])
        chats.append(turns)
    if shape.order == "probe-first" and probes:  # one small image a request, first
        chats[:0] = [[[(base + 990 + n, SIZES["64x64"])]] for n in range(PROBES)]
    return chats


@dataclass
class Run:
    seconds: float
    requests: int
    queries: float
    hits: float
    api_ms: float  # CPU per request
    engine_ms: float
    total_ms: float  # API, engine and the sidecar: all a request cost the machine
    uploaded: float
    declined: float
    # Prompt tokens the engines found in their prefix caches: with data
    # parallelism a chat's next turn that lands on the other engine finds
    # none, and its images are encoded again (engine CPU neither side chose).
    prefix_hits: float


def run(served: Deployment, trace: Trace) -> Run:
    before, seen = served.cpu(), served.vllm_metrics()
    start = time.perf_counter()

    def conversation(turns: list[list[Image]]) -> None:
        for turn in turns:
            served.chat_images(turn)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(conversation, trace.chats))
    seconds = time.perf_counter() - start
    time.sleep(0.5)
    used, now = (served.cpu() - before).per(trace.requests), served.vllm_metrics()

    def delta(name: str) -> float:
        return now.get(name, 0.0) - seen.get(name, 0.0)

    return Run(
        seconds,
        trace.requests,
        delta("vllm:mm_cache_queries_total"),
        delta("vllm:mm_cache_hits_total"),
        used.api * 1e3,
        used.engine * 1e3,
        used.total * 1e3,
        delta("mmcache_vllm_uploaded_items_total"),
        delta("mmcache_vllm_not_uploaded_items_total"),
        delta("vllm:prefix_cache_hits_total"),
    )


def median(runs: list[Run]) -> Run:
    return Run(*(statistics.median(getattr(r, f) for r in runs) for f in Run.__dataclass_fields__))


def row(trace: Trace, label: str, alone: Run, cached: Run, spread: tuple[float, float]) -> str:
    return (
        f"| {trace.name} ({trace.seed}) | {label} "
        f"| {cached.hits:.0f} / {alone.hits:.0f} ({cached.queries:.0f}) "
        f"| {cached.queries - cached.hits:.0f} / {alone.queries - alone.hits:.0f} "
        f"/ {trace.unique} "
        f"| {cached.requests / cached.seconds:.2f} / {alone.requests / alone.seconds:.2f} "
        f"({spread[0]:.2f}-{spread[1]:.2f}x) "
        f"| {cached.api_ms:.0f} / {alone.api_ms:.0f} "
        f"| {cached.engine_ms:.0f} / {alone.engine_ms:.0f} "
        f"| {cached.prefix_hits / 1e3:.1f} / {alone.prefix_hits / 1e3:.1f} "
        f"| {cached.total_ms:.0f} / {alone.total_ms:.0f} "
        f"| {cached.uploaded:.0f} / {cached.declined:.0f} |"
    )


@dataclass
class Ratios:
    """mmcache against vLLM alone on one trace and configuration (medians)."""

    trace: str
    config: str
    hits: float  # mmcache's hits less vLLM alone's (never negative is the rule)
    runs_per_unique: float  # mmcache's processor runs per unique image
    throughput: float  # requests/s, mmcache / alone
    api_cpu: float  # API CPU per request, mmcache / alone
    engine_cpu: float
    all_cpu: float


def ratios(trace: Trace, label: str, alone: Run, cached: Run) -> Ratios:
    return Ratios(
        trace.name,
        label,
        cached.hits - alone.hits,
        (cached.queries - cached.hits) / max(1, trace.unique),
        (cached.requests / cached.seconds) / (alone.requests / alone.seconds),
        cached.api_ms / max(alone.api_ms, 1e-9),
        cached.engine_ms / max(alone.engine_ms, 1e-9),
        cached.total_ms / max(alone.total_ms, 1e-9),
    )


def summary(found: list[Ratios]) -> None:
    """The family's medians and its worst trace, per measure (README's headline)."""
    print("\n| measure (mmcache against vLLM alone) | family median | worst | worst trace |")
    print("|---|---|---|---|")
    measures = (
        ("hits, mmcache less alone", "hits", min),
        ("processor runs per unique image", "runs_per_unique", max),
        ("requests/s ratio", "throughput", min),
        ("API CPU per request ratio", "api_cpu", max),
        ("engine CPU per request ratio", "engine_cpu", max),
        ("all CPU per request ratio (the sidecar's too)", "all_cpu", max),
    )
    for title, field, pick in measures:
        values = [getattr(r, field) for r in found]
        worst = pick(found, key=lambda r: getattr(r, field))
        print(
            f"| {title} | {statistics.median(values):.2f} | {getattr(worst, field):.2f} "
            f"| {worst.trace}, {worst.config} |"
        )


def table(
    model: Path,
    traces: list[Trace],
    configs: list[tuple[str, int, int]],
    repeats: int,
    fresh: bool,
) -> list[Ratios]:
    """Per configuration, `repeats` rounds of vLLM alone and mmcache in turn
    (each first in every other round: the machine's drift hits both alike).
    A round's deployment serves the traces one after the other (their images
    are distinct, so a trace finds only the earlier traces' items taking
    room), or, with `fresh`, each trace gets a deployment of its own."""
    print(
        "| trace | config | hits: mmcache / vLLM alone (of queries) | processor runs: "
        "mmcache / alone / unique images | requests/s: mmcache / alone (each round's ratio, "
        "least-most) | API CPU ms/req: mmcache / alone | engine CPU ms/req: mmcache / alone "
        "| engine prefix-cache hits, k tokens: mmcache / alone | all CPU ms/req (the "
        "sidecar's too): mmcache / alone | uploads made / declined |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    found = []
    for label, api_servers, dp in configs:
        runs: dict[tuple[str, bool], list[Run]] = {}
        for round_ in range(repeats):
            # Each side goes first in every other round, so that a drift of
            # the machine within a round does not favour one side.
            for with_mmcache in (False, True) if round_ % 2 == 0 else (True, False):
                groups = [[t] for t in traces] if fresh else [traces]
                for group in groups:
                    with deployment(model, api_servers, with_mmcache, dp) as served:
                        for trace in group:
                            runs.setdefault((trace.name, with_mmcache), []).append(
                                run(served, trace)
                            )
        for trace in traces:
            alones, cacheds = runs[trace.name, False], runs[trace.name, True]
            alone, cached = median(alones), median(cacheds)
            # Rounds ran in turn (alone and mmcache): each round's own ratio.
            each = [
                (c.requests / c.seconds) / (a.requests / a.seconds)
                for a, c in zip(alones, cacheds, strict=True)
            ]
            print(row(trace, label, alone, cached, (min(each), max(each))), flush=True)
            found.append(ratios(trace, label, alone, cached))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--short", action="store_true", help="two traces, 1 and 4 API servers")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--api-servers", default="1,2,4")
    parser.add_argument("--data-parallel", action="store_true", help="also 2 engines (DP)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--fresh", action="store_true", help="a deployment per trace")
    parser.add_argument("--traces", default="", help="only these, comma-separated (same seeds)")
    args = parser.parse_args()
    stop_on_sigterm()  # the deployments stop with the bench
    named = set(args.traces.split(",")) - {""}
    unknown = named - {s.name for s in FAMILY}
    if unknown:
        parser.error(f"no trace {sorted(unknown)} in the family: {[s.name for s in FAMILY]}")
    # Seeds follow the family's order, so a trace run alone is the same trace.
    traces = [
        draw(shape, args.seed + n)
        for n, shape in enumerate(FAMILY)
        if (not args.short or shape.name in SHORT) and (not named or shape.name in named)
    ]
    # `--api-servers ""` with --data-parallel: the data-parallel rows alone.
    counts = [1, 4] if args.short else [int(x) for x in args.api_servers.split(",") if x]
    configs = [(f"{n} API", n, 1) for n in counts]
    if args.data_parallel:
        configs.append(("2 engines (DP)", 0, 2))
    for trace in traces:
        print(trace.describe())
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "tiny-qwen2-vl", REAL_PIXELS)
        summary(table(model, traces, configs, args.repeats, args.fresh))


if __name__ == "__main__":
    main()
