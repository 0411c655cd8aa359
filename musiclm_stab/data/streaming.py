"""Random crops from a streamed tokenized dataset, split across processes and loader workers by rule.

``StreamingCrops`` reads a ``datasets.IterableDataset`` (``load_tokenized(..., streaming=True)``) in one
pass per epoch and does the split across processes itself (see its docstring for the rule and what it
guarantees); ``ArrowFile`` reads single columns and rows of the memory-mapped part files.
"""

from __future__ import annotations

import bisect
import functools
import mmap
from collections import OrderedDict

import datasets
import numpy as np
import pyarrow as pa
from datasets.iterable_dataset import ArrowExamplesIterable
from torch.utils.data import IterableDataset, get_worker_info

from musiclm_stab.constants import FRAME_RATE, HOP_LENGTH
from musiclm_stab.data.crops import crop_item, crop_start, eval_tracks, example_key


class ArrowFile:
    """One arrow file of a tokenized dataset, memory-mapped: its record batches and the row each starts at.

    Only the batches' metadata is read up front. The map is marked random-access (no read-around), so
    reading ``track`` and ``num_frames`` of every row reads only their pages, not the ``pcm`` and ``codes``
    between them; ``prefetch`` reads what a row's crop needs in one request instead of page by page.
    A file that is not arrow data raises ValueError naming it.
    """

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if hasattr(self.map, "madvise"):  # not on Windows
                self.map.madvise(mmap.MADV_RANDOM)
            buffer = pa.py_buffer(self.map)
            self.base = buffer.address
            try:  # the tokenizer and save_to_disk write the stream format; the file format is read as well
                self.batches = list(pa.ipc.open_stream(buffer))
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(buffer)
                self.batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except (OSError, ValueError) as e:  # ValueError: an empty file; pa.ArrowInvalid is one too
            raise ValueError(f"{path}: not a readable arrow file: {e}") from e
        self.starts = np.cumsum([0] + [b.num_rows for b in self.batches]).tolist()

    def columns(self, names: list[str], validate: bool = False):
        """Per record batch, the columns ``names`` (pyarrow arrays). ``validate`` first checks each batch's
        structure in full (offsets, strings; this reads no float or integer values)."""
        for batch in self.batches:
            if validate:
                try:
                    batch.validate(full=True)
                except pa.ArrowInvalid as e:
                    raise ValueError(f"{self.path}: damaged arrow data: {e}") from e
            missing = [n for n in names if n not in batch.schema.names]
            if missing:
                raise ValueError(f"{self.path} is not a tokenized dataset: columns {missing} are missing")
            yield [batch.column(n) for n in names]

    def value(self, name: str, row: int, type: pa.DataType | None = None):
        """Column ``name`` of row ``row`` (of the file) as a pyarrow scalar, cast to ``type`` if given."""
        b = bisect.bisect_right(self.starts, row) - 1
        column = self.batches[b].column(name)
        if type is not None and column.type != type:
            return column.slice(row - self.starts[b], 1).cast(type)[0]
        return column[row - self.starts[b]]

    def prefetch(self, view: np.ndarray) -> None:
        """Have the kernel read the pages under ``view`` (a zero-copy view into this file) in one go."""
        if not hasattr(self.map, "madvise") or view.nbytes == 0:
            return
        offset = view.__array_interface__["data"][0] - self.base
        if 0 <= offset and offset + view.nbytes <= len(self.map):  # else a copy (a cast), already in memory
            start = offset - offset % mmap.PAGESIZE
            self.map.madvise(mmap.MADV_WILLNEED, start, offset + view.nbytes - start)


# Private parts of datasets (pyproject.toml bounds datasets below 5.3 for them): no public API gives the files
# behind a stream (IterableDataset._ex_iterable.kwargs) or builds a stream of arrow tables sharded and shuffled
# as load_dataset("arrow", streaming=True) shards and shuffles its files (ArrowExamplesIterable).
OPEN_FILES = 32  # memory-mapped files a loader worker keeps open (the stream interleaves at most 10)


def stream_files(stream) -> list[str]:
    """The arrow files behind a ``load_tokenized(path, streaming=True)`` stream, in stream order."""
    ex = getattr(stream, "_ex_iterable", None)
    files = ex.kwargs.get("files") if isinstance(ex, ArrowExamplesIterable) else None
    if not files or not all(isinstance(f, str) for f in files):
        raise TypeError("StreamingCrops reads the stream of load_tokenized(path, streaming=True) (arrow "
                        f"files on disk, not shuffled or mapped yet); got {stream!r}")
    return list(files)


def _row_tables(files: list[str], index: dict[str, int]):
    """Stand-in for datasets' arrow reader behind the stream: one table per record batch of each file, as
    it yields them (so datasets' shard and buffer shuffling, which depends only on the table lengths,
    orders them the same), but holding only ``track``, ``num_frames`` and the row's place (``file``: its
    index in the stream's files, ``row``: in the file)."""
    for file_idx, path in enumerate(files):
        arrow = ArrowFile(path)
        for batch_idx, ((track, frames), first) in enumerate(zip(arrow.columns(["track", "num_frames"]),
                                                                 arrow.starts)):
            n = len(track)
            yield (file_idx, batch_idx), pa.table({
                "track": track, "num_frames": frames, "file": pa.array([index[path]] * n, pa.int32()),
                "row": pa.array(range(first, first + n), pa.int64())})


class StreamingCrops(IterableDataset):
    """Random crops from a streamed tokenized dataset; yields this process's micro-batches (lists of items,
    as CropDataset makes them) of one epoch. Use with ``DataLoader(batch_size=None, collate_fn=Collator)``.

    The rule: an epoch is one pass over the stream (in file order, or through a seeded shuffle buffer of
    ``shuffle_buffer`` rows, 0 = no shuffle). Its training examples (rows of held-out tracks and rows
    shorter than the crop left out) are numbered k = 0, 1, ...; each run of ``batch_size * world_size``
    consecutive examples is one global batch, of which process ``rank`` takes the ``rank``-th
    ``batch_size`` examples; a last, incomplete global batch is dropped. So the processes read disjoint
    examples, together all of the epoch's but that remainder, and a global batch holds the same examples
    at any world size. Loader workers take every ``num_workers``-th micro-batch, so the order does not
    depend on them.

    Reading: the order is that of ``stream`` (the ``datasets`` stream of ``load_tokenized``, shuffled by
    ``datasets``), but it is worked out from the ``track`` and ``num_frames`` columns alone (``_row_tables``,
    read from the memory-mapped files); each process and loader worker then reads the ``pcm`` and
    ``codes`` of its own rows only (of the crop only, for ``pcm``). The files of other processes' and
    workers' rows, and of skipped ones, are never read.

    The held-out tracks are those of ``split_indices`` on the same rows, found at construction by a read of
    the ``track`` and ``num_frames`` columns (the files' structure is checked then), which also counts the
    micro-batches of an epoch (``len``). Crops are seeded by (seed, epoch, example), the example being a
    hash of its ``id``: the same at any world size. ``seed`` (the run's data order seed, ``data.order_seed``
    or ``train.seed``) also seeds the shuffle buffer. ``skip`` micro-batches at the start of the epoch are
    passed over without reading them (exact resume).
    """

    def __init__(self, stream, eval_fraction: float, crop_seconds: float, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, shuffle_buffer: int = 0):
        self.crop_frames = int(round(crop_seconds * FRAME_RATE))
        self.files = stream_files(stream)
        schema = stream.features.arrow_schema if stream.features is not None else None
        self.types = {c: schema.field(c).type if schema is not None and c in schema.names else None
                      for c in ("pcm", "codes")}
        index = {path: i for i, path in enumerate(self.files)}
        # The stream's own shard list (same kwargs): datasets shuffles the files of both alike.
        shards = dict(stream._ex_iterable.kwargs)
        rows = ArrowExamplesIterable(functools.partial(_row_tables, index=index), shards)
        self.rows = datasets.IterableDataset(rows).with_format("arrow")
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.shuffle_buffer, self.epoch, self.skip = seed, shuffle_buffer, 0, 0
        tracks, frames = [], []
        for path in self.files:
            for track, num_frames in ArrowFile(path).columns(["track", "num_frames"], validate=True):
                tracks += track.to_pylist()
                frames += num_frames.to_pylist()
        self.held_out = eval_tracks(tracks, eval_fraction)
        train = [n for t, n in zip(tracks, frames) if t not in self.held_out]
        self.num_examples = sum(n >= self.crop_frames for n in train)
        self.num_skipped = len(train) - self.num_examples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_examples // (self.batch_size * self.world_size)

    def __iter__(self):
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        order = self.rows
        if self.shuffle_buffer:  # the calls the stream itself would take: the same order
            order = order.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer)
            order.set_epoch(self.epoch)
        opened: OrderedDict[int, ArrowFile] = OrderedDict()  # files of this worker's rows, newest last
        per_global, num_batches, k, mine = self.batch_size * self.world_size, len(self), 0, []
        for table in order.iter(batch_size=64):
            columns = [table.column(c).to_pylist() for c in ("track", "num_frames", "file", "row")]
            for track, n, file, row in zip(*columns):
                if track in self.held_out or n < self.crop_frames:
                    continue
                batch, pos = divmod(k, per_global)
                k += 1
                if batch >= num_batches:
                    return
                if (pos // self.batch_size != self.rank or batch < self.skip
                        or (batch - self.skip) % num_workers != worker_id):  # the loader reads worker 0 first
                    continue
                if file not in opened:
                    opened[file] = ArrowFile(self.files[file])
                    if len(opened) > OPEN_FILES:  # each holds a file descriptor
                        opened.popitem(last=False)
                opened.move_to_end(file)
                mine.append(self._item(opened[file], row))
                if len(mine) == self.batch_size:
                    yield mine
                    mine = []

    def _item(self, arrow: ArrowFile, row: int) -> dict:
        pcm = arrow.value("pcm", row, self.types["pcm"]).values.to_numpy(zero_copy_only=False)  # a view
        rows = arrow.value("codes", row, self.types["codes"]).values  # K lists of T codes
        codes = rows.flatten().to_numpy(zero_copy_only=False).reshape(len(rows), -1)
        index = example_key(arrow.value("id", row).as_py())
        start = crop_start(index, codes.shape[-1], self.crop_frames, (self.seed, self.epoch))
        arrow.prefetch(pcm[start * HOP_LENGTH:(start + self.crop_frames) * HOP_LENGTH])
        arrow.prefetch(codes)
        return crop_item(index, pcm, codes, self.crop_frames, (self.seed, self.epoch), start)
