"""Chunks back into MLX caches, written straight into buffers made for them.

Each layer is rebuilt as the class mlx-lm's model code expects of it: full attention as kvmesh's
sparse caches (mlx-lm's KVCache cannot hold evicted positions), sliding windows as RotatingKVCache,
recurrent state as ArraysCache, chunked attention as ChunkedKVCache, composite layers as CacheList.

The decoder writes each chunk into per-tensor MLX buffers through their zero-copy numpy views, so
decoding needs about one copy of the cache in memory, never the whole encoded payload.
"""

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from concurrent import futures

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import CacheList

from kvmesh.caches.kinds import arrays_from_state, chunked_from_arrays, window_from_arrays
from kvmesh.caches.sparse import SparseKVCache, SparseQuantizedKVCache
from kvmesh.codec.arrays import DTYPES, UINT_OF_SIZE, Layer, all_finite, mlx_shape, uint_view, write_rows
from kvmesh.codec.basis import Basis, BasisError
from kvmesh.codec.chunks import DECODE_THREADS, Chunk, ChunkChecker, Raw, ordered_map
from kvmesh.codec.coded import decode_coded
from kvmesh.codec.layer_blob import TransformCodecError
from kvmesh.codec.layer_pool import layer_pool
from kvmesh.codec.manifest import ITEMSIZE, leaf_layers, tensor_dtype, token_major
from kvmesh.codec.prediction import LayerChain
from kvmesh.errors import IntegrityError
from kvmesh.model.fingerprint import dtype_name
from kvmesh.v1 import cache_pb2 as pb


class CacheDecoder:
    """Rebuilds caches from checked chunks, written straight into buffers made for them.

    Each tensor's buffer is made when its first chunk arrives, on the thread that feeds the chunks
    (MLX arrays are made on one thread): making them all up front would delay the transfer's start,
    making them while other threads receive slows both, and a fetch cut short never allocates the rest.
    """

    def __init__(
        self, manifest: pb.CacheManifest, bases: Mapping[str, Basis] | None = None, *, quantize_bits: int | None = None
    ):
        """`bases`: the transform bases the manifest names (CacheManifest.artifacts), by sha256.
        `quantize_bits`: transform-coded layers come back quantized to that many bits (mlx-lm's
        quantized attention path; groups of 64), for a receiver short of memory."""
        self.manifest = manifest
        self.bases = bases or {}
        self.quantize_bits = quantize_bits
        self.checker = ChunkChecker(manifest)
        kinds = [layer.kind for _, layer in leaf_layers(manifest.layers) for _ in layer.tensors]
        self.layouts = [token_major(kind) for kind in kinds]
        self.shapes = [
            (mlx_shape(kind, list(spec.shape)), UINT_OF_SIZE[ITEMSIZE[tensor_dtype(spec)]])
            for spec, kind in zip(self.checker.specs, kinds, strict=True)
        ]
        self.buffers: list[mx.array | None] = [None] * len(self.shapes)
        self.views: list[np.ndarray | None] = [None] * len(self.shapes)
        # Transform-coded layers decode as soon as their last chunk is in, on the layer threads
        # (kvmesh.codec.layer_pool) while later chunks arrive: by the index of that chunk, the tensor
        # and its layer; decoding, in order; decoded, by tensor.
        leaves = [layer for _, layer in leaf_layers(manifest.layers) for _ in layer.tensors]
        last = {slot.tensor: i for i, slot in enumerate(self.checker.plan)}
        self.coded_at = {
            last[t]: (t, layer)
            for t, layer in enumerate(leaves)
            if layer.kind == pb.CACHE_KIND_TRANSFORM_KV and t in last
        }
        # Their bytes are a blob for the decoder, not a tensor of the cache: received into NumPy, or,
        # a blob in one chunk (a layer of up to a chunk's size: all of SmolLM2's and an 8B model's
        # up to about 8K tokens), read where its chunk's check left them (the wire's message, or what
        # zstd made): no buffer and no copy. By tensor, until its layer starts to decode.
        self.coded_tensors = {t for t, _ in self.coded_at.values()}
        chunks_of = Counter(slot.tensor for slot in self.checker.plan)
        self.whole_blobs = {t for t in self.coded_tensors if chunks_of[t] == 1}
        self._blobs: dict[int, Raw] = {}
        self.coded: dict[int, Layer] = {}
        self._decoding: list[tuple[int, futures.Future[Layer]]] = []
        self._memo: dict = {}  # rotation tables, shared by the coded layers' threads
        # Their coefficients, for the layers predicted from the one before (kvmesh.codec.prediction).
        self._chain = LayerChain()
        # Whether `settle` passed, or what it raised.
        self._settled = False
        self._failure: Exception | None = None

    def _planned_tensor(self, chunk: Chunk) -> int | None:
        """The tensor where the plan puts `chunk` (not where it claims to go); None beyond the plan
        (the checker refuses it)."""
        return self.checker.plan[chunk.index].tensor if chunk.index < len(self.checker.plan) else None

    def _allocate(self, chunk: Chunk) -> Chunk:
        """Make the buffer of the tensor where the plan puts `chunk`."""
        if (tensor := self._planned_tensor(chunk)) is not None:
            self._buffer(tensor)
        return chunk

    def _buffer(self, tensor: int) -> mx.array | None:
        """The tensor's MLX buffer, made now if need be (None for a transform-coded layer's bytes:
        a NumPy buffer of their own, read by its decoder and dropped; none for a blob in one chunk)."""
        if self.views[tensor] is None and tensor not in self.whole_blobs:
            shape, dtype = self.shapes[tensor]
            if tensor in self.coded_tensors:
                self.views[tensor] = np.empty(shape[1:], np.dtype(f"uint{8 * dtype.size}"))
            else:
                buffer = mx.zeros(shape, dtype)
                mx.eval(buffer)
                self.buffers[tensor], self.views[tensor] = buffer, uint_view(buffer)[0]
        return self.buffers[tensor]

    def feed_all(self, chunks: Iterable[Chunk], threads: int = DECODE_THREADS) -> None:
        for _ in self.feed_iter(chunks, threads):
            pass

    def feed_iter(
        self, chunks: Iterable[Chunk], threads: int = DECODE_THREADS, *, settle: bool = True
    ) -> Iterator[Chunk]:
        """Feed chunks, yielding each in order once it is checked and written; after the last, check
        that the payload is complete and its digest the manifest's, then `settle` (all decoded, finite).

        Each chunk is checked against its slot, decoded and written into its own rows on one of
        `threads` threads while the caller brings the next (a transform-coded layer's chunk, short
        work, here when none is in flight: its layer then starts to decode at once, `ordered_map`'s
        `inline`); the order check runs here, so a chunk out of place never lands outside its
        announced rows and still fails the transfer.
        What this yields may go to a store as it comes (`store.add(manifest, decoder.feed_iter(...))`):
        a bad chunk or digest, or a tensor of numbers that are not finite, raises before the store's
        write completes, so nothing is kept.

        With `settle=False` it ends after the digest, coded layers maybe still decoding: the store's
        last write and sync then overlap their decoding, and the store settles before it commits
        (`store.add(manifest, decoder.feed_iter(chunks, settle=False), before_commit=decoder.settle)`).
        """

        def decode(chunk: Chunk) -> Chunk:
            self._write(chunk, self.checker.decode(chunk))
            return chunk

        try:
            for chunk in ordered_map(decode, map(self._allocate, chunks), threads, inline=self._codes_a_layer):
                self.checker.accept(chunk)
                if chunk.index in self.coded_at:
                    self._start_coded(*self.coded_at[chunk.index])
                self._collect_coded(wait=False)  # a layer that failed fails the transfer now
                yield chunk
            self.checker.finish()
        except BaseException:  # (a failure, or a consumer that stopped early)
            self.stop()
            raise
        if settle:
            self.settle()

    def _codes_a_layer(self, chunk: Chunk) -> bool:
        """Whether `chunk` holds a transform-coded layer's bytes (by where the plan puts it)."""
        return self._planned_tensor(chunk) in self.coded_tensors

    def settle(self) -> None:
        """Wait for the coded layers still decoding (raising the first failure), then check that every
        tensor that arrived as it is holds finite numbers: what must hold before the cache is kept or
        used. Once is enough: later calls return at once, or raise the same failure again."""
        if self._failure is not None:
            raise self._failure
        if self._settled:
            return
        try:
            try:
                self._collect_coded(wait=True)
            finally:
                self.stop()
            self._check_finite()
        except Exception as e:
            self._failure = e
            raise
        self._settled = True

    def _check_finite(self) -> None:
        """Every float tensor that arrived as it is holds finite numbers (coded layers are checked as
        they decode): checksums prove the bytes are the sender's, not that they are a cache."""
        for i, (spec, buffer) in enumerate(zip(self.checker.specs, self.buffers, strict=True)):
            dtype = DTYPES[tensor_dtype(spec)]
            if buffer is not None and mx.issubdtype(dtype, mx.floating) and not all_finite(buffer, dtype):
                raise IntegrityError(f"tensor {i} ({spec.name}) of the cache holds NaN or infinite numbers")

    def _start_coded(self, tensor: int, layer: pb.LayerSpec) -> None:
        """Decode a transform-coded layer whose bytes are all in (each chunk checked) on the coded
        layers' threads (`kvmesh.codec.layer_pool`) while the next ones arrive; taken in order."""
        if tensor in self.whole_blobs:
            raw = self._blobs.pop(tensor)
            blob = raw.data if isinstance(raw, np.ndarray) else memoryview(raw)
        else:
            view = self.views[tensor]
            assert view is not None, "a coded tensor is decoded once its chunks are written"
            blob = view.reshape(-1).view(np.uint8).data  # (its chunks are all in: nothing writes it again)
        self._chain.expect(layer.transform.basis_layer)  # (before it is handed out: `LayerChain`)
        self._decoding.append((tensor, layer_pool().submit(self._decode_coded, layer, blob)))

    def _collect_coded(self, *, wait: bool) -> None:
        """Take the coded layers decoded so far (all of them when `wait`), raising the first failure."""
        while self._decoding and (wait or self._decoding[0][1].done()):
            tensor, future = self._decoding.pop(0)
            self.coded[tensor] = future.result()

    def stop(self) -> None:
        """Cancel the coded layers not started and wait for those running (the pool is the process's):
        what a receiver that gives up on the cache calls (a failure, an early exit)."""
        for _, future in self._decoding:
            future.cancel()
        self._chain.close("the transfer stopped before the layer it is predicted from decoded")
        futures.wait([future for _, future in self._decoding])
        self._decoding = []
        self._blobs.clear()

    def _decode_coded(self, layer: pb.LayerSpec, blob: memoryview) -> Layer:
        """A transform-coded layer into its SparseKVCache (or the quantized cache asked for)."""
        try:
            dtype = DTYPES[dtype_name(self.manifest.dtype)]
            decoded = decode_coded(layer, blob, self.bases, dtype, self._memo, self._chain)
            if self.quantize_bits is None:
                return decoded
            quantized = decoded.to_quantized(bits=self.quantize_bits)
            mx.eval(quantized.keys_and_values())
            return quantized
        except (BasisError, TransformCodecError) as e:
            # Its bytes matched their checksums: the sender coded it wrong, or with another basis.
            raise IntegrityError(f"a transform-coded layer does not decode: {e}") from None
        except MemoryError:
            raise
        except Exception as e:  # a blob consistent with its checksums whose content MLX cannot take
            raise IntegrityError(f"a transform-coded layer does not decode: {type(e).__name__}: {e}") from None

    def _write(self, chunk: Chunk, raw: Raw) -> None:
        slot = self.checker.plan[chunk.index]
        if slot.tensor in self.whole_blobs:
            self._blobs[slot.tensor] = raw
            return
        view = self.views[slot.tensor]
        assert view is not None, "a chunk is decoded only once its buffer is made"
        write_rows(view, self.layouts[slot.tensor], slot.byte_offset // slot.row_bytes, raw)

    def finish(self) -> list[Layer]:
        """Check the payload is complete and intact, then hand over the caches."""
        self.checker.finish()
        self.settle()
        # Tensors of no bytes had no chunk to make theirs.
        buffers = [self._buffer(i) for i in range(len(self.buffers))]
        tensors = iter(enumerate(zip(self.checker.specs, buffers, strict=True)))

        def rebuild(layer: pb.LayerSpec) -> Layer:
            if layer.kind == pb.CACHE_KIND_LIST:
                return CacheList(*(rebuild(part) for part in layer.parts))
            held = [next(tensors) for _ in layer.tensors]
            if layer.kind == pb.CACHE_KIND_TRANSFORM_KV:
                return self.coded[held[0][0]]
            arrays = [buf.view(DTYPES[tensor_dtype(spec)]) for _, (spec, buf) in held if buf is not None]
            return rebuild_layer(layer, arrays)

        caches = [rebuild(layer) for layer in self.manifest.layers]
        self.buffers, self.views = [], []
        return caches


def rebuild_layer(layer: pb.LayerSpec, arrays: list[mx.array]) -> Layer:
    """One cache object from its decoded tensors (in manifest order); transform-coded layers need
    their basis (CacheDecoder)."""
    if layer.kind == pb.CACHE_KIND_SPARSE_QUANTIZED_KV:
        return SparseQuantizedKVCache.from_arrays(
            tuple(arrays[:3]), tuple(arrays[3:]), layer.offset, layer.group_size, layer.bits
        )
    if layer.kind == pb.CACHE_KIND_ROTATING_KV:
        return window_from_arrays(arrays[0], arrays[1], layer.offset, layer.window, layer.keep)
    if layer.kind == pb.CACHE_KIND_ARRAYS:
        return arrays_from_state(arrays)
    if layer.kind == pb.CACHE_KIND_CHUNKED_KV:
        return chunked_from_arrays(arrays[0], arrays[1], layer.offset, layer.chunk_size, layer.start_position)
    return SparseKVCache.from_arrays(arrays[0], arrays[1], layer.offset)


def decode_chunks(
    manifest: pb.CacheManifest,
    chunks: Iterable[Chunk],
    *,
    bases: Mapping[str, Basis] | None = None,
    threads: int = DECODE_THREADS,
) -> list[Layer]:
    """The caches a manifest and its chunks describe, every chunk and the digest verified.

    With a store: `decode_chunks(store.manifest(cache_id), store.chunks(cache_id), bases=...)`.
    """
    decoder = CacheDecoder(manifest, bases)
    decoder.feed_all(chunks, threads)
    return decoder.finish()
