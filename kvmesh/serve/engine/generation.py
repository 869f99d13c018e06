"""The server's generation thread: mlx-lm's generation, the mesh's prompt cache, a bounded queue.

MLX generation stays on this one thread; HTTP handlers hand it jobs and read events back from a queue.
A job first has its prefix found on a lookup thread (memory, then the local store and the peers:
a store read or a peer's transfer takes seconds, and must hold no other request), then waits its
turn for the generation thread, in the order the lookups end: a request behind a slow peer fetch is
served meanwhile. A request's text streams as it is made; the request completes (finish reason,
usage) once its cache is in memory; a writer thread then keeps it, when long enough, in the local
store, so that neither the answer nor the batch's next tokens wait for the disk.
Jobs whose caches mlx-lm can merge decode together in mlx-lm's `BatchGenerator`
(kvmesh.serve.engine.batch), those from the store and the peers as well as those made here; the others (a
cache with evicted or quantized positions, a seed, a grammar or thinking budget) are generated one
at a time with `stream_generate` (kvmesh.serve.engine.solo), a token of it after each step of the batch:
neither waits for the other. At most `max_held` requests are held at
once (looking up, waiting or generating); past that `submit` raises `Busy`, which the API answers
with a 429 and Retry-After rather than a queue that only grows. A job whose client left holds no
place: it is skipped when its turn comes, or stopped within a token (within a prefill chunk of
PREFILL_STEP tokens when it is prefilling), and so is every job when the server stops.
Sampling and stopping are mlx-lm's: `make_sampler`, `make_logits_processors` (penalties, logit
bias), `stream_generate` (EOS ids from the tokenizer), plus stop strings, which are cut from the text
and never streamed. A job may add logits processors of its own (a grammar: kvmesh.serve.grammar),
and ask for each token's log probability (and the most likely alternatives) from mlx-lm's.
"""

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any

import mlx.nn as nn
from mlx_lm.generate import GenerationResponse

from kvmesh.reuse.calibration import ensure_calibrated
from kvmesh.reuse.records import CachedPrefix
from kvmesh.serve.engine.batch import Batch, batchable, batchable_model, merge_ready
from kvmesh.serve.engine.jobs import Abandoned, Job, Output, Started
from kvmesh.serve.engine.prompt_cache import MeshPromptCache
from kvmesh.serve.engine.solo import Solo

# Named for the engine, as its log lines always were (a user's filters and the tests read them by it).
log = logging.getLogger("kvmesh.serve.engine")

# Prompt tokens prefilled between two looks at whether the job is still wanted (mlx-lm's default is
# 2,048): a client that leaves, or a server told to stop, waits at most one such chunk.
PREFILL_STEP = 512
# Lookups at once: each may wait on a store read or a peer's transfer (up to the idle timeout).
LOOKUP_THREADS = 8
# What a refused client is told to wait before trying again (seconds, the Retry-After header).
RETRY_AFTER_S = 1
# How long a stop waits for the store's write of an answered request's cache (it follows the answer):
# a write of a long conversation's new blocks takes a fraction of a second, a `--compress` one seconds.
STORE_WRITE_GRACE_S = 30.0


class Busy(Exception):
    """The server holds as many requests as it may: this one is refused (429) rather than queued."""


class Place:
    """A request's place among the held ones, taken before its prompt is rendered and tokenized (a
    long one takes seconds): past the bound a request is refused before that work, not after it.
    `submit` hands it to the request's job; `release` gives it back when the request is refused."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()  # (never set: a place is held until submitted or released)


class Engine:
    """Finds each job's prefix on a lookup thread, then generates on one thread: batched, or in turn."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        prompt_cache: MeshPromptCache,
        *,
        max_held: int = 64,
        batching: bool = True,
    ):
        """`batching`: decode jobs whose caches mlx-lm can merge together (kvmesh.serve.engine.batch); without
        it every job is generated alone, one after another."""
        self.model, self.tokenizer, self.prompt_cache = model, tokenizer, prompt_cache
        self.max_held, self.batching = max_held, batching
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lookups = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="kvmesh-lookup")
        self._lock = threading.Lock()
        # id(job) -> (job, "lookup" | "waiting" | "generating"); a Place counts as "lookup"
        self._held: dict[int, tuple[Job | Place, str]] = {}
        self._stopping = threading.Event()
        # Answered requests' caches go to the store on a thread of their own, one after another (so the
        # last one queued ends after all the others), so that neither the answer nor the batch's next
        # tokens wait for a disk.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-store-write")
        self._last_write: Future[None] | None = None
        # Set once the engine can answer (after calibration): /health says "starting" until then.
        self.ready = threading.Event()
        self._served = 0
        # What the generation thread is doing, in words: a stop that it outlasts says so.
        self.doing = "starting"
        self._thread = threading.Thread(target=self._run, name="kvmesh-generate", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def held(self) -> dict[str, int]:
        """How many requests are making their prompt or looking up its prefix, waiting for
        generation, generating (a job whose client left is not counted: it holds no place)."""
        counts = {"lookup": 0, "waiting": 0, "generating": 0}
        with self._lock:
            for job, stage in self._held.values():
                if not job.cancelled.is_set():
                    counts[stage] += 1
        return counts

    def take_place(self) -> Place:
        """A place for a request whose job is still to be made; `Busy` when `max_held` are held."""
        place = Place()
        with self._lock:
            self._check_room()
            self._held[id(place)] = (place, "lookup")
        return place

    def release(self, place: Place) -> None:
        """Give back the place of a request that was refused before its job was submitted."""
        self._release(place)

    def _check_room(self) -> None:
        if sum(not j.cancelled.is_set() for j, _ in self._held.values()) >= self.max_held:
            raise Busy(f"the server holds {self.max_held} requests already")

    def submit(self, job: Job, place: Place | None = None) -> Job:
        """Hold `job` (in `place`, when the request took one) and look up its prefix; `Busy` when
        `max_held` requests are held already."""
        with self._lock:
            if place is None or self._held.pop(id(place), None) is None:
                self._check_room()
            self._held[id(job)] = (job, "lookup")
        job.submitted = time.monotonic()
        try:
            self._lookups.submit(self._look_up, job)
        except RuntimeError:  # shut down: the server is stopping
            self._release(job)
            raise Busy("the server is stopping") from None
        return job

    def stop(self) -> None:
        """Take no more jobs, and answer every held one Abandoned now: its client is told at once,
        even while the generation thread finishes a prefill chunk or a token (it then drops it)."""
        self._stopping.set()
        self._lookups.shutdown(wait=False)
        self._jobs.put(None)
        with self._lock:
            held = [job for job, _ in self._held.values() if isinstance(job, Job)]
        for job in held:
            if not job.cancelled.is_set():
                job.put(Abandoned("the server is stopping"))

    def close(self, timeout: float = 1.0, *, write_grace: float = STORE_WRITE_GRACE_S) -> bool:
        """Stop, and wait for the generation thread: whether it ended within `timeout` seconds and
        the store's writes of answered requests' caches within `write_grace` more (a stop right after
        an answer keeps its cache, as when the answer waited for the write)."""
        self.stop()
        self._thread.join(timeout=timeout)
        last = self._last_write
        if last is not None and not last.done():
            log.info("finishing the store's writes of answered requests' caches before stopping")
            wait([last], timeout=write_grace)
        self._writer.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive() and last is not None and not last.done():
            self.doing = "keeping answered requests' caches in the store"
            return False
        return not self._thread.is_alive()

    def _drop(self, job: Job) -> None:
        """A job not served: nobody waits for it (its client left), or the server is stopping."""
        self._release(job)
        if not job.cancelled.is_set():
            job.put(Abandoned("the server is stopping"))

    def _stage(self, job: Job, stage: str) -> None:
        with self._lock:
            if id(job) in self._held:
                self._held[id(job)] = (job, stage)

    def _release(self, job: Job | Place) -> None:
        with self._lock:
            self._held.pop(id(job), None)

    def _wanted(self, job: Job) -> bool:
        return not (job.cancelled.is_set() or self._stopping.is_set())

    def _look_up(self, job: Job) -> None:
        """On a lookup thread: the store's and the peers' prefix, then the job's turn to generate."""
        if not self._wanted(job):
            self._drop(job)
            return
        try:
            job.found = self.prompt_cache.look_up(job.tokens, partition=job.partition, client=job.client)
        except Exception as e:  # reported to this request; the others go on
            log.exception("prefix lookup failed")
            self._release(job)
            job.put(e)
            return
        self._stage(job, "waiting")
        self._jobs.put(job)

    def _announce_calibration(self) -> None:
        log.info("calibrating this machine's prefill and decode rates (a few prefills) before the first request")
        self.doing = "calibrating this machine's prefill and decode rates"

    def _run(self) -> None:
        rates = self.prompt_cache.rates
        start = time.monotonic()
        # Before the first request's choice: what is not measured yet here is measured now.
        if rates is not None and ensure_calibrated(
            self.model, self.prompt_cache.model_fp, rates, announce=self._announce_calibration
        ):
            log.info("calibrated in %.1f s", time.monotonic() - start)
        self.ready.set()
        batch = (
            Batch(self.model, self.tokenizer, prefill_step=PREFILL_STEP, wanted=self._wanted, finished=self._complete)
            if self.batching and batchable_model(self.model)
            else None
        )
        # Jobs the batch cannot take, in arrival order, and the one of them generating: a token of
        # it after each step of the batch, so neither holds the other.
        alone: deque[tuple[Job, CachedPrefix]] = deque()
        solo: Solo | None = None
        try:
            while not self._stopping.is_set():
                busy = solo is not None or bool(alone) or (batch is not None and len(batch) > 0)
                self.doing = "waiting for requests"
                for job in self._arrivals(block=not busy):
                    if not self._wanted(job):
                        self._drop(job)
                        continue
                    self._stage(job, "generating")
                    try:
                        hit = self._start(job)
                    except Exception as e:  # reported to this request; the thread serves the next one
                        log.exception("prefix fetch failed")
                        self._release(job)
                        job.put(e)
                        continue
                    if batch is not None and batchable(job, hit):
                        batch.add(job, hit)
                    else:
                        alone.append((job, hit))
                if batch is not None and len(batch) > 0:
                    self.doing = f"prefilling or generating {len(batch)} batched request(s)"
                    try:
                        batch.step()
                    except Exception as e:  # every job of the batch is told; the engine goes on
                        log.exception("batched generation failed")
                        for slot in list(batch.slots.values()):
                            self._release(slot.job)
                            slot.job.put(e)
                        batch.close()
                        batch = Batch(
                            self.model,
                            self.tokenizer,
                            prefill_step=PREFILL_STEP,
                            wanted=self._wanted,
                            finished=self._complete,
                        )
                if solo is None and alone:
                    solo = self._solo(*alone.popleft())
                if solo is not None:
                    self.doing = "prefilling or generating a request alone"
                    solo = solo if self._step(solo) else None
        finally:
            if batch is not None:
                for slot in batch.slots.values():
                    self._release(slot.job)
                batch.abandon()
                batch.close()
            if solo is not None:
                self._drop(solo.job)
            for job, _ in alone:
                self._drop(job)
            while True:  # stopping: those still queued are told so
                try:
                    if (left := self._jobs.get_nowait()) is not None:
                        self._drop(left)
                except queue.Empty:
                    break

    def _arrivals(self, block: bool) -> list[Job]:
        """The jobs whose turn has come: every one queued now, waiting for one when `block`."""
        jobs: list[Job] = []
        try:
            first = self._jobs.get(block=block)
        except queue.Empty:
            return jobs
        while first is not None:
            jobs.append(first)
            try:
                first = self._jobs.get_nowait()
            except queue.Empty:
                return jobs
        self._stopping.set()  # None: close() was called
        return jobs

    def _start(self, job: Job) -> CachedPrefix:
        """The job's prefix, from memory or as its lookup found it; its Started event."""
        hit = self.prompt_cache.fetch(job.tokens, partition=job.partition, client=job.client, found=job.found)
        hit = replace(hit, cache=merge_ready(hit.cache))  # a cache from the mesh batches as one made here
        job.found = None  # (the engine keeps no cache past its request)
        job.put(Started(len(job.tokens), hit.tokens))
        return hit

    def _solo(self, job: Job, hit: CachedPrefix) -> Solo | None:
        """The job's generation on its own, or None when it is no longer wanted."""
        if not self._wanted(job):
            self._drop(job)
            return None
        return Solo(
            self.model,
            self.tokenizer,
            job,
            hit,
            prefill_step=PREFILL_STEP,
            wanted=self._wanted,
            prefilled=self._prefilled,
            finished=self._complete,
        )

    def _step(self, solo: Solo) -> bool:
        """A token of `solo`'s job; False once it ended (done, left, or failed: its client is told)."""
        try:
            return solo.step()
        except Abandoned:
            log.info("request abandoned in its prefill (%s)", "stopping" if self._stopping.is_set() else "left")
        except Exception as e:  # reported to this request; the thread serves the next one
            log.exception("generation failed")
            self._release(solo.job)
            solo.job.put(e)
        return False

    def _prefilled(self, response: GenerationResponse, hit: CachedPrefix) -> None:
        """A job's prefill is done: its rate refreshes this machine's prefill rate."""
        if self.prompt_cache.rates is not None:
            self.prompt_cache.rates.record_prefill(
                self.prompt_cache.model_fp.model_id,
                response.prompt_tokens,
                response.prompt_tokens / response.prompt_tps if response.prompt_tps else 0.0,
                context=hit.tokens,
            )

    def _complete(self, job: Job, output: Output, hit: CachedPrefix, cache: list[Any] | None) -> None:
        """A job's end: the rest of its text, its cache kept in memory, Done (and its log line), then
        its cache kept in the store. Memory has it before the request completes, so that the next
        request here finds it; the store's write (for peers, and for after a restart) comes after
        the answer, which never waits for a disk. A job that ended in its prefill (`cache` None)
        only leaves."""
        self._release(job)
        if cache is None:
            if self._stopping.is_set():
                job.put(Abandoned("the server is stopping"))
            return
        output.flush()
        self.doing = "keeping a request's cache"
        covered = self.prompt_cache.insert(
            job.tokens + output.generated, cache, partition=job.partition, client=job.client
        )
        done = output.done(hit)
        self._served += 1
        log.info(
            "request %d: %d prompt tokens, %d cached from %s (%.3f s), %d generated (%s, %s); first token "
            "after %.3f s, %.1f tokens/s",
            self._served,
            done.prompt_tokens,
            done.cached_tokens,
            done.prefix.where,
            done.prefix.seconds,
            done.completion_tokens,
            done.finish_reason if self._wanted(job) else "stopped" if self._stopping.is_set() else "client left",
            f"in a batch of up to {output.batch_size}" if output.batch_size else "alone",
            (output.first_token or time.monotonic()) - job.submitted,
            output.tokens_per_second(),
        )
        if job.partition is None:  # a salted request's cache stays in its own partition of memory
            # Queued before the answer is out: a stop that follows the answer waits for the write.
            # (Memory's entries are never extended in place, so the writer reads what was answered.)
            try:
                self._last_write = self._writer.submit(self._keep_in_store, covered, cache, self._served)
            except RuntimeError:  # the writer is shut down: the stop's grace for writes is spent
                log.warning("request %d's cache was not kept in the store: the server stopped", self._served)
        job.put(done)

    def _keep_in_store(self, covered: tuple[int, ...], cache: list[Any], served: int) -> None:
        """An answered request's cache into the store, on the writer's thread. Its answer is out and
        the batch goes on, so whatever goes wrong here reaches no request: it is logged, and memory
        still has the cache."""
        start = time.monotonic()
        try:
            kept = self.prompt_cache.persist(covered, cache)
        except Exception:
            log.exception("request %d's cache was not kept in the store", served)
            kept = False
        if kept:
            log.info(
                "kept request %d's cache of %d tokens in the store (%.3f s)",
                served,
                len(covered),
                time.monotonic() - start,
            )
