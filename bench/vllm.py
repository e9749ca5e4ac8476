"""vLLM alone beside vLLM with mmcache, on photo-like JPEGs, measured in CPU.

    .venv-vllm/bin/python -m bench.vllm [--sizes 1024x1024,...] [--api-servers 1,4]
                                        [--traces repeat,distinct] [--only hit|replay|ec]

Runs in the vLLM environment (scripts/vllm-env.sh; `make bench` does). The
model is the tests' tiny random-weight Qwen2-VL, built offline, with
Qwen2-VL's real pixel limits (a 1024x1024 image is 1369 tokens; vLLM keeps
its `pixel_values` as uint8, 6.44 MB). The images are JPEGs made here
(bench/photos.py: photo-like, quality 90) at 448x448, 1280x720, 1024x1024
and 1920x1080. vLLM alone is `vllm serve`; with mmcache it is the same
command with MMCACHE_TARGET naming a fresh sidecar on this host (so the
engine reads hits from its shared memory).

CPU is read from /proc (user + system time of every process of the run:
the API servers, the launcher included; the engine core and its worker;
and, to the nanosecond from each thread's schedstat, the sidecar and the
plugin's client threads), so the figures are what a hit or a miss costs,
not what the two shared cores happened to let the wall clock show.

Three tables:

1. **What a hit costs, and what it saves** (`--only hit`), per image size,
   one API server: 16 new images, each sent twice in a row, one request at a
   time: the first is a miss, the second a hit (and the plugin, seeing half
   its items come back, uploads every one). Processing is the CPU of vLLM's
   processor per item in the API server, the image's decode included (the
   plugin's own counters); a hit's cost is the CPU of mmcache's client
   threads (the API server's and the engine's: the plugin names them) and
   of the sidecar, per hit; beside it, what the hit requests cost the API
   server and the engine against vLLM alone's hits (its own engine cache
   serves them), and a miss's cost to mmcache (the upload).
2. **Replays** (`--only replay`), at each size and API-server count: the
   repeat trace (multi-turn chats, four at a time, each turn re-sending the
   chat's earlier images, from a pool of 8 images) and the all-distinct
   trace (the same requests, every image new). Requests/s, latency p50/p99,
   CPU ms per request (API servers, engine, sidecar, and all), processor
   runs (vLLM's queries less its hits), and the MB the API servers sent the
   engine inline and the MB the engine read from the sidecar.
3. **The EC connector** (`--only ec`): two engines taking turns on the
   repeat trace, without a connector, with a sidecar each and with one
   shared: vision-encoder runs, runs avoided, bytes loaded, latency.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from pathlib import Path

from bench import stop_on_sigterm, thread_cpu_ns
from bench.photos import SIZES, data_url
from mmcache.client.vllm.runtime import THREAD_NAME
from tests.vllm.conftest import Sidecar, free_port
from tests.vllm.serve import metrics, serve_command, wait_healthy
from tests.vllm.tiny_model import REAL_PIXELS, build

ROOT = Path(__file__).resolve().parent.parent
POOL = 8  # distinct images of the repeat trace
HIT_PHASE = 16  # requests per phase of the hit table
TICK = os.sysconf("SC_CLK_TCK")
# Room for four 1920x1080 images (2691 tokens each) in one prompt.
ENGINE_OPTIONS = (
    *("--limit-mm-per-prompt", '{"image": 4}', "--max-model-len", "12288"),
    *("--max-num-batched-tokens", "12288"),
)
MB = 1e6

Size = tuple[int, int]


def trace(conversations: int, seed: int) -> list[list[list[int]]]:
    """Per conversation, per turn, the images (pool indices) sent so far."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** 1.1 for rank in range(POOL)]
    chats = []
    for _ in range(conversations):
        images: list[int] = []
        turns = []
        for _ in range(rng.randint(1, 4)):
            image = rng.choices(range(POOL), weights)[0]
            if image not in images:
                images.append(image)
            turns.append(list(images))
        chats.append(turns)
    return chats


def all_distinct(chats: list[list[list[int]]], first: int) -> list[list[list[int]]]:
    """The same requests, every image in them a new one (seeds from `first`)."""
    seeds = iter(range(first, first + 1_000_000))
    return [[[next(seeds) for _ in turn] for turn in turns] for turns in chats]


# --- CPU from /proc ---------------------------------------------------------


def _stat(path: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a live process or thread (its /proc path)."""
    try:
        with open(f"{path}/stat", encoding="ascii") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def _comm(path: str) -> str:
    try:
        with open(f"{path}/comm", encoding="utf-8") as file:
            return file.read().strip()
    except OSError:
        return ""


def _threads_cpu(pid: int, name: str | None = None) -> float:
    """CPU seconds of the process's threads (those named `name`: the plugin
    names its client threads, client/vllm/runtime.py), to the nanosecond."""
    threads = thread_cpu_ns(pid).values()
    return sum(ns for comm, ns in threads if name is None or comm == name) / 1e9


@dataclass
class Cpu:
    """CPU seconds, by part of the deployment; `api_client` and `engine_client`
    are the part of `api` and `engine` that mmcache's client threads used."""

    api: float = 0.0
    engine: float = 0.0
    sidecar: float = 0.0
    api_client: float = 0.0
    engine_client: float = 0.0
    # Of `api` and `engine`: what the plugin did on vLLM's own threads with no
    # call (hits leased and read in shared memory), as its clients report it
    # to the sidecar (mmcache_shm_client_cpu_seconds_total).
    inline: float = 0.0

    @property
    def total(self) -> float:
        return self.api + self.engine + self.sidecar

    @property
    def mmcache(self) -> float:
        """What mmcache itself used: its client threads, its work on vLLM's
        threads, and the sidecar."""
        return self.api_client + self.engine_client + self.inline + self.sidecar

    def __add__(self, other: Cpu) -> Cpu:
        return Cpu(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def per(self, n: float) -> Cpu:
        return Cpu(*(a / n for a in astuple(self)))


def cpu(vllm_pid: int, sidecar_pid: int | None) -> Cpu:
    """The CPU used so far by `vllm serve`'s processes and by the sidecar."""
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (found := _stat(f"/proc/{name}")) is not None:
            stats[int(name)] = found
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    used = Cpu()
    stack = [vllm_pid]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, ()))
        seconds = stats.get(pid, (0, 0.0))[1]
        if _comm(f"/proc/{pid}").startswith(("VLLM::EngineCor", "VLLM::Worker")):
            used.engine += seconds
            used.engine_client += _threads_cpu(pid, THREAD_NAME)
        else:  # the API servers, and the launcher that started them
            used.api += seconds
            used.api_client += _threads_cpu(pid, THREAD_NAME)
    if sidecar_pid is not None:
        used.sidecar = _threads_cpu(sidecar_pid)
    return used


# --- one deployment ---------------------------------------------------------


@dataclass
class Deployment:
    port: int
    proc: subprocess.Popen[bytes]
    sidecar: Sidecar | None
    size: Size = (1024, 1024)

    def cpu(self) -> Cpu:
        side = self.sidecar.proc.pid if self.sidecar and self.sidecar.proc else None
        return cpu(self.proc.pid, side)

    def vllm_metrics(self) -> dict[str, float]:
        return metrics(f"http://127.0.0.1:{self.port}/metrics")

    def sidecar_metrics(self) -> dict[str, float]:
        if self.sidecar is None:
            return {}
        return metrics(f"http://127.0.0.1:{self.sidecar.metrics_port}/metrics")

    def chat(self, images: list[int], size: Size | None = None) -> float:
        return self.chat_images([(seed, size or self.size) for seed in images])

    def chat_images(self, images: list[tuple[int, Size]]) -> float:
        """One request of the images (seed, size); its wall seconds."""
        content: list[dict[str, object]] = [
            {"type": "image_url", "image_url": {"url": _url(width, height, seed)}}
            for seed, (width, height) in images
        ]
        content.append({"type": "text", "text": "What is in these images?"})
        body = {"model": "", "max_tokens": 4, "temperature": 0, "messages": [
            {"role": "user", "content": content}]}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()
        return time.perf_counter() - start


_urls: dict[tuple[int, int, int], str] = {}


def _url(width: int, height: int, seed: int) -> str:
    key = (width, height, seed)
    if key not in _urls:
        _urls[key] = data_url(width, height, seed)
    return _urls[key]


@contextmanager
def deployment(
    model: Path, api_servers: int, with_mmcache: bool, data_parallel: int = 1
) -> Iterator[Deployment]:
    """`vllm serve` (with `api_servers`, or vLLM's default with 0; with
    `data_parallel` engines), alone or with the plugin and a fresh sidecar."""
    sidecar = Sidecar(capacity_gb=2, env={"MMCACHE_SHM_MB": "1024"}) if with_mmcache else None
    port = free_port()
    env = {} if sidecar is None else {"MMCACHE_TARGET": sidecar.target}
    options = [*ENGINE_OPTIONS, "--data-parallel-size", str(data_parallel)]
    if api_servers:
        options += ["--api-server-count", str(api_servers)]
    proc = None
    try:  # (whatever stops the bench, a signal too, stops both)
        if sidecar is not None:
            sidecar.start()
        proc = subprocess.Popen(
            serve_command(str(model), port, *options),
            cwd=ROOT,
            env={
                **os.environ,
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_LOGGING_LEVEL": "WARNING",
                **env,
            },
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_healthy(port, proc, timeout=300)
        served = Deployment(port, proc, sidecar)
        # Warm every API server's paths (the first request of a process pays
        # its imports), with images no trace sends.
        for n in range(2 * max(api_servers, data_parallel)):
            served.chat([900_000_000 + n], (448, 448))
        yield served
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        if sidecar is not None:
            sidecar.stop()


# --- table 1: a hit's cost ----------------------------------------------------


@dataclass
class Phase:
    cpu: Cpu  # per request
    counts: dict[str, float]  # vLLM's /metrics, what the run added
    seconds: float = 0.0  # wall time per request, the CPU samples' window

    def per(self, name: str, of: str) -> float:
        return self.counts.get(name, 0.0) / max(1.0, self.counts.get(of, 0.0))


def pairs(served: Deployment, seeds: list[int], size: Size) -> tuple[Phase, Phase]:
    """Each image twice in a row (a miss, then a hit): the CPU of the first
    requests, and of the second. Alternating keeps this process's hit ratio
    at a half, so the plugin uploads every item (a run of new images would
    rightly stop it) and every second request is a hit."""
    seen = served.vllm_metrics()
    inline = served.sidecar_metrics().get("mmcache_shm_client_cpu_seconds_total", 0.0)
    first, second = Cpu(), Cpu()
    walls = [0.0, 0.0]
    for seed in seeds:
        for index, phase in enumerate((first, second)):
            before, started = served.cpu(), time.perf_counter()
            served.chat([seed], size)
            time.sleep(0.05)  # the request's background work (an upload) ends in its window
            used = served.cpu() - before
            walls[index] += time.perf_counter() - started
            for name in ("api", "engine", "sidecar", "api_client", "engine_client"):  # not inline
                setattr(phase, name, getattr(phase, name) + getattr(used, name))
    now = served.vllm_metrics()
    counts = {name: now[name] - seen.get(name, 0.0) for name in now}
    # Only hits lease and read with no call: the run's reported total is theirs.
    second.inline = served.sidecar_metrics().get("mmcache_shm_client_cpu_seconds_total", 0.0)
    second.inline -= inline
    n = len(seeds)
    return (
        Phase(first.per(n), counts, walls[0] / n),
        Phase(second.per(n), counts, walls[1] / n),
    )


def idle(served: Deployment, seconds: float = 3.0) -> Cpu:
    """CPU per second of a deployment serving nothing (timers, polling)."""
    before = served.cpu()
    time.sleep(seconds)
    return (served.cpu() - before).per(seconds)


def hit_table(model: Path, sizes: list[Size]) -> None:
    print(
        f"\nWhat a hit costs: one API server, {HIT_PHASE} new images, each sent twice in a "
        "row, one request at a time (the first a miss, the second a hit); CPU ms per item. "
        "Processing: the CPU of vLLM's processor in the API server (the image's decode "
        "included), per item it processed (the plugin's counters); mmcache: the CPU of its "
        "client threads in the API server and the engine, of what it did on vLLM's own "
        "threads with no call (as reported to the sidecar), and of the sidecar (/proc), "
        "less what they use serving nothing (measured first, per second of the window)"
    )
    print(
        "| image | item MB | processing "
        "| mmcache per hit: API + engine client threads + on vLLM's threads + sidecar "
        "| hit / processing | hit vs vLLM alone's: API / engine | mmcache per miss (upload) "
        "| hits (alone / mmcache) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    phases: dict[tuple[bool, Size], tuple[Phase, Phase]] = {}
    resting = Cpu()
    for with_mmcache in (False, True):
        with deployment(model, 1, with_mmcache) as served:
            if with_mmcache:
                resting = idle(served)
            for n, size in enumerate(sizes):
                seeds = [10_000 * (n + 1) + i for i in range(HIT_PHASE)]
                phases[with_mmcache, size] = pairs(served, seeds, size)
            if with_mmcache:  # before and after: one idle window alone moves by a third
                resting = (resting + idle(served)).per(2)
    for size in sizes:
        (_, hit_a), (miss_m, hit_m) = phases[False, size], phases[True, size]
        processing = miss_m.per(
            "mmcache_vllm_processing_cpu_seconds_total", "mmcache_vllm_processed_items_total"
        )
        upload = miss_m.per(
            "mmcache_vllm_upload_cpu_seconds_total", "mmcache_vllm_uploaded_items_total"
        )
        # What mmcache's threads use serving nothing (timers, polling: about
        # resting.mmcache per second) is no hit's cost: taken out, per window.
        cost = hit_m.cpu - resting.per(1 / hit_m.seconds)
        versus = hit_m.cpu - hit_a.cpu

        def hits(run: Phase) -> str:
            return f"{run.counts.get('vllm:mm_cache_hits_total', 0.0):.0f}"

        print(
            f"| {size[0]}x{size[1]} | {item_mb(model, size):.2f} | {processing * 1e3:.1f} "
            f"| {cost.mmcache * 1e3:.2f} ({cost.api_client * 1e3:.2f} + "
            f"{cost.engine_client * 1e3:.2f} + {cost.inline * 1e3:.2f} + "
            f"{cost.sidecar * 1e3:.2f}) "
            f"| {cost.mmcache / processing:.0%} "
            f"| {versus.api * 1e3:+.1f} / {versus.engine * 1e3:+.1f} "
            f"| {(miss_m.cpu.api_client + miss_m.cpu.sidecar) * 1e3:.2f} ({upload * 1e3:.2f}) "
            f"| {hits(hit_a)} / {hits(hit_m)} of {HIT_PHASE} |",
            flush=True,
        )
    print(
        f"mmcache serving nothing: {resting.mmcache * 1e3:.1f} ms of CPU per second (sidecar "
        f"{resting.sidecar * 1e3:.1f}, client threads {resting.api_client * 1e3:.1f} + "
        f"{resting.engine_client * 1e3:.1f})"
    )


def item_mb(model: Path, size: Size) -> float:
    """An image's pixel_values MB as vLLM keeps them (uint8: a byte per value)."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model).image_processor
    out = processor(images=[Image.new("RGB", size)], return_tensors="pt")
    return float(out["pixel_values"].numel()) / MB


# --- table 2: replays ---------------------------------------------------------


@dataclass
class Replay:
    seconds: float
    latencies: list[float]
    cpu: Cpu
    queries: float
    hits: float
    inline_mb: float
    sidecar_mb: float
    requests: int  # per run (a median's latencies are pooled over its runs)


def replay(served: Deployment, chats: list[list[list[int]]], item: float) -> Replay:
    before, seen, side = served.cpu(), served.vllm_metrics(), served.sidecar_metrics()
    start = time.perf_counter()

    def conversation(turns: list[list[int]]) -> list[float]:
        return [served.chat(images) for images in turns]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        latencies = [t for ts in pool.map(conversation, chats) for t in ts]
    seconds = time.perf_counter() - start
    time.sleep(0.5)
    used, now, side_now = served.cpu() - before, served.vllm_metrics(), served.sidecar_metrics()

    def delta(name: str, new: dict[str, float], old: dict[str, float]) -> float:
        return new.get(name, 0.0) - old.get(name, 0.0)

    queries = delta("vllm:mm_cache_queries_total", now, seen)
    hits = delta("vllm:mm_cache_hits_total", now, seen)
    sent = delta("mmcache_sent_bytes_total", side_now, side)
    # Every item has the same size: a processed item goes inline; vLLM alone
    # with several API servers ships every item (its caches are per process).
    inline = (queries - hits) * item
    return Replay(seconds, latencies, used, queries, hits, inline, sent / MB, len(latencies))


def median_run(runs: list[Replay]) -> Replay:
    """The runs' medians, figure by figure; their latencies pooled."""

    def mid(values: list[float]) -> float:
        return statistics.median(values)

    cpus = [astuple(run.cpu) for run in runs]
    return Replay(
        mid([run.seconds for run in runs]),
        [t for run in runs for t in run.latencies],
        Cpu(*(mid([c[i] for c in cpus]) for i in range(len(cpus[0])))),
        mid([run.queries for run in runs]),
        mid([run.hits for run in runs]),
        mid([run.inline_mb for run in runs]),
        mid([run.sidecar_mb for run in runs]),
        runs[0].requests,
    )


def replay_table(
    model: Path,
    sizes: list[Size],
    counts: list[int],
    traces: list[str],
    chats: list[list[list[int]]],
    repeats: int = 1,
) -> None:
    requests = sum(len(t) for t in chats)
    refs = sum(len(images) for t in chats for images in t)
    print(
        f"\nReplays: {len(chats)} chats, {requests} requests, {refs} images sent, four chats "
        f"at a time; repeat: {POOL} distinct images; distinct: every image new; "
        f"the median of {repeats} runs, vLLM alone and mmcache in turn"
    )
    print(
        "| image | trace | API servers | cache | requests/s | p50 / p99 ms "
        "| CPU ms/request: API / engine / sidecar / all | of which mmcache's client threads "
        "| processor runs | MB inline "
        "| MB from sidecar |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    first = 1_000_000
    for size in sizes:
        item = item_mb(model, size)
        for name in traces:
            for n in counts:
                runs: dict[bool, list[Replay]] = {False: [], True: []}
                for _ in range(repeats):  # in turn: the machine's drift hits both alike
                    for with_mmcache in (False, True):
                        # A fresh deployment per run; the distinct trace's
                        # images are new to every deployment too.
                        sent = chats if name == "repeat" else all_distinct(chats, first)
                        first += 1000
                        with deployment(model, n, with_mmcache) as served:
                            served.size = size
                            runs[with_mmcache].append(replay(served, sent, item))
                for with_mmcache in (False, True):
                    run = median_run(runs[with_mmcache])
                    used = run.cpu.per(run.requests)
                    cuts = statistics.quantiles(run.latencies, n=100, method="inclusive")
                    inline = run.queries * item if (n > 1 and not with_mmcache) else run.inline_mb
                    print(
                        f"| {size[0]}x{size[1]} | {name} | {n} "
                        f"| {'mmcache' if with_mmcache else 'vLLM alone'} "
                        f"| {run.requests / run.seconds:.2f} "
                        f"| {cuts[49] * 1e3:.0f} / {cuts[98] * 1e3:.0f} "
                        f"| {used.api * 1e3:.0f} / {used.engine * 1e3:.0f} / "
                        f"{used.sidecar * 1e3:.0f} / {used.total * 1e3:.0f} "
                        f"| {used.api_client * 1e3:.1f} / {used.engine_client * 1e3:.1f} "
                        f"| {run.queries - run.hits:.0f} of {run.queries:.0f} "
                        f"| {inline:.0f} | {run.sidecar_mb:.0f} |",
                        flush=True,
                    )


# --- table 3: the EC connector ----------------------------------------------


def ec_config(sidecar: Sidecar) -> str:
    return json.dumps(
        {
            "ec_connector": "CountingECConnector",
            "ec_connector_module_path": "tests.vllm.counting_ec",
            "ec_role": "ec_both",
            "ec_connector_extra_config": {"target": sidecar.target},
        }
    )


@dataclass
class Fleet:
    encoded: float | None
    loaded: float
    loaded_bytes: float
    latencies: list[float]


def replay_fleet(
    model: Path, chats: list[list[list[int]]], size: Size, sidecars: list[Sidecar] | None
) -> Fleet:
    """Two engines taking turns: turn i of a chat goes to engine i % 2."""
    ports = [free_port(), free_port()]
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, port in enumerate(ports):
            options = list(ENGINE_OPTIONS)
            env = {"MMCACHE_TEST_ENCODER_CALLS": f"{tmp}/calls{i}"}
            if sidecars is not None:
                options += ["--ec-transfer-config", ec_config(sidecars[i])]
            procs.append(
                subprocess.Popen(
                    serve_command(str(model), port, *options),
                    cwd=ROOT,
                    env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        try:
            engines = []
            for port, proc in zip(ports, procs, strict=True):
                wait_healthy(port, proc, timeout=300)
                engines.append(Deployment(port, proc, None, size))

            def conversation(turns: list[list[int]]) -> list[float]:
                return [engines[i % 2].chat(images) for i, images in enumerate(turns)]

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                latencies = [t for ts in pool.map(conversation, chats) for t in ts]
            time.sleep(2)  # vLLM publishes its stats a step after the work
            seen = [engine.vllm_metrics() for engine in engines]
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(60)

    def total(name: str) -> float:
        return sum(m.get(f"mmcache_ec_{name}_total", 0.0) for m in seen)

    encoded = total("encoded") if sidecars is not None else None
    return Fleet(encoded, total("loaded"), total("loaded_bytes"), latencies)


def ec_table(model: Path, chats: list[list[list[int]]], size: Size) -> None:
    print(f"\nEC connector, 2 engines taking turns, {size[0]}x{size[1]} images")
    print("| cache of encoder outputs | encoder runs | runs avoided (loaded) | MB loaded "
          "| latency p50 / p99 ms |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name in ("vLLM alone", "one sidecar per engine", "one shared sidecar"):
        sidecars = None
        if name != "vLLM alone":
            shared = Sidecar(capacity_gb=2)
            sidecars = [shared, shared] if name == "one shared sidecar" else [shared, Sidecar(2)]
        for sidecar in set(sidecars or ()):
            sidecar.start()
        try:
            run = replay_fleet(model, chats, size, sidecars)
        finally:
            for sidecar in set(sidecars or ()):
                sidecar.stop()
        cuts = statistics.quantiles(run.latencies, n=100, method="inclusive")
        encoded = "not counted" if run.encoded is None else f"{run.encoded:.0f}"
        print(
            f"| {name} | {encoded} | {run.loaded:.0f} | {run.loaded_bytes / MB:.1f} "
            f"| {cuts[49] * 1e3:.0f} / {cuts[98] * 1e3:.0f} |",
            flush=True,
        )


def _sizes(text: str) -> list[Size]:
    return [(int(w), int(h)) for w, h in (part.split("x") for part in text.split(","))]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    every = ",".join(f"{w}x{h}" for w, h in SIZES)
    parser.add_argument("--sizes", default=every, help="image sizes of the hit table")
    parser.add_argument(
        "--replay-sizes", default="1024x1024", help="image sizes of the replays and the EC table"
    )
    parser.add_argument("--api-servers", default="1,4")
    parser.add_argument("--traces", default="repeat,distinct")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per replay row (their median is printed)"
    )
    parser.add_argument("--only", choices=("hit", "replay", "ec"), help="one table only")
    args = parser.parse_args()
    stop_on_sigterm()  # the deployments stop with the bench
    chats = trace(args.conversations, args.seed)
    replay_sizes = _sizes(args.replay_sizes)
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "tiny-qwen2-vl", REAL_PIXELS)
        if args.only in (None, "hit"):
            hit_table(model, _sizes(args.sizes))
        if args.only in (None, "replay"):
            counts = [int(x) for x in args.api_servers.split(",")]
            traces = args.traces.split(",")
            replay_table(model, replay_sizes, counts, traces, chats, args.repeats)
        if args.only in (None, "ec"):
            ec_table(model, chats, replay_sizes[0])


if __name__ == "__main__":
    main()
