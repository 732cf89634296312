"""Megatron's indexed dataset format (``<prefix>.bin`` / ``<prefix>.idx``), read memory-mapped and written.

The format of Megatron-LM's ``preprocess_data.py`` and Megatron-Core's ``IndexedDatasetBuilder``, which NeMo, LiBai
and MindFormers also read. ``.bin`` holds the token ids of every sequence back to back in one integer dtype;
``.idx`` is, little-endian:

========================================  ======================================================================
``b"MMIDIDX\\x00\\x00"``                  magic (9 bytes)
``<Q`` 1                                  version
``<B`` code                               the token dtype: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                          6 float64, 7 float32, 8 uint16
``<Q`` sequences, ``<Q`` documents        counts (``documents`` is the length of the document index below)
int32 × sequences                         each sequence's length in tokens
int64 × sequences                         each sequence's byte offset in ``.bin``
int64 × documents                         the document index: 0, then the sequence count after each document
========================================  ======================================================================

A document is one or more sequences (sentences, when split so); GPT training reads sequences, Megatron's own
``GPTDataset`` being split by sequence. Nothing here is read into memory: lengths, offsets and tokens are views of
the mapped files.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from types import TracebackType

import numpy as np

from ...errors import MindFormersError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
"""Megatron's dtype codes (``megatron.core.datasets.indexed_dataset.DType``)."""
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes before the arrays


def optimal_dtype(vocab_size: int | None) -> type[np.integer]:
    """The token dtype Megatron's ``preprocess_data.py`` writes for a vocabulary: uint16 below 65,500 ids, else
    int32 (``DType.optimal_dtype``)."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def bin_path(prefix: str | os.PathLike[str]) -> Path:
    """``<prefix>.bin``."""
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike[str]) -> Path:
    """``<prefix>.idx``."""
    return Path(f"{os.fspath(prefix)}.idx")


def exists(prefix: str | os.PathLike[str]) -> bool:
    """Whether both files of an indexed dataset are there."""
    return bin_path(prefix).is_file() and idx_path(prefix).is_file()


class IndexedDataset:
    """A Megatron indexed dataset, memory-mapped: ``dataset[i]`` is sequence i's token ids (a read-only numpy view
    of ``.bin``), :meth:`get` a slice of one.

    Args:
        prefix: the path without ``.bin`` / ``.idx`` (e.g. ``data/corpus_text_document``).

    Raises:
        MindFormersError: a file is missing, or ``.idx`` is not an indexed dataset's index or does not match
            ``.bin``.
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = os.fspath(prefix)
        index_file, data_file = idx_path(prefix), bin_path(prefix)
        for path in (index_file, data_file):
            if not path.is_file():
                raise MindFormersError(f"data_path prefix {self.prefix!r} has no {path.name} (an indexed dataset is "
                                       "<prefix>.bin + <prefix>.idx, as `mindformers-py preprocess` or Megatron's "
                                       "preprocess_data.py write them)")
        with open(index_file, "rb") as f:
            head = f.read(_HEADER)
        if len(head) < _HEADER or head[:len(MAGIC)] != MAGIC:
            raise MindFormersError(f"{index_file} is not a Megatron indexed dataset index (its first bytes are not "
                                   f"{MAGIC!r})")
        version, code, sequences, documents = struct.unpack("<QBQQ", head[len(MAGIC):])
        if version != VERSION or code not in DTYPE_CODES:
            raise MindFormersError(f"{index_file} has version {version} and dtype code {code}; this reader knows "
                                   f"version {VERSION} and codes {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER + 12 * sequences + 8 * documents
        size = index_file.stat().st_size
        if size < expected:
            raise MindFormersError(f"{index_file} is truncated: {size} bytes, its header announces {expected}")
        self._index = np.memmap(index_file, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(self._index, np.int32, sequences, _HEADER)
        """Tokens of each sequence (int32, mapped)."""
        self.sequence_pointers = np.frombuffer(self._index, np.int64, sequences, _HEADER + 4 * sequences)
        """Byte offset of each sequence in ``.bin`` (int64, mapped)."""
        self.document_indices = np.frombuffer(self._index, np.int64, documents, _HEADER + 12 * sequences)
        """0, then the number of sequences after each document (int64, mapped)."""
        tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        if data_file.stat().st_size != tokens * self.dtype.itemsize:
            raise MindFormersError(f"{data_file} holds {data_file.stat().st_size} bytes but {index_file} indexes "
                                   f"{tokens} tokens of {self.dtype.itemsize} bytes; the two files do not belong "
                                   "together (rewrite them)")
        self._data = np.memmap(data_file, mode="r", dtype=self.dtype) if tokens else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset + length`` of sequence ``i`` (to its end when ``length`` is None)."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        return self._data[start:start + length]

    @property
    def num_tokens(self) -> int:
        """Tokens in the whole dataset."""
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def num_documents(self) -> int:
        """Documents in the dataset."""
        return len(self.document_indices) - 1

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}  # DataLoader workers map the files again rather than copy them

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])


class IndexedDatasetWriter:
    """Writes ``<prefix>.bin`` / ``<prefix>.idx`` in Megatron's format, under temporary names renamed when
    :meth:`finalize` completes (an interrupted write leaves no half-written dataset under the final names).

    Use it as a context manager, or call :meth:`finalize`; leaving the block by an exception removes the temporary
    files.

    Args:
        prefix: output path without extension.
        dtype: the token dtype (see :func:`optimal_dtype`); one of Megatron's.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: type[np.number] | np.dtype = np.int32) -> None:
        self.dtype = np.dtype(dtype)
        codes = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
        if self.dtype not in codes:
            raise MindFormersError(f"dtype {self.dtype} is not one of Megatron's: {', '.join(map(str, codes))}")
        self._code = codes[self.dtype]
        self.prefix = os.fspath(prefix)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        suffix = f".tmp-{os.getpid()}"
        self._tmp_bin = Path(f"{bin_path(prefix)}{suffix}")
        self._tmp_idx = Path(f"{idx_path(prefix)}{suffix}")
        self._data = open(self._tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []
        self._document_ends: list[np.ndarray] = []
        self._sequences = 0

    def add_document(self, tokens: np.ndarray | list[int], lengths: list[int] | np.ndarray | None = None) -> None:
        """Append one document: ``tokens`` split into sequences of ``lengths`` (one sequence when None)."""
        tokens = np.asarray(tokens)
        lengths = np.asarray([len(tokens)] if lengths is None else lengths, dtype=np.int64)
        self.add_documents(tokens, lengths, np.asarray([len(lengths)], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, sequence_lengths: np.ndarray, sequences_per_document: np.ndarray) -> None:
        """Append many documents at once: their tokens back to back, each sequence's length and each document's
        number of sequences (the fast path of :mod:`~mindformers_py.data.megatron.preprocess`)."""
        sequence_lengths = np.asarray(sequence_lengths, dtype=np.int64)
        if int(sequence_lengths.sum()) != len(tokens):
            raise MindFormersError(f"{len(tokens)} tokens do not add up to the sequence lengths' "
                                   f"{int(sequence_lengths.sum())}")
        self._check_range(tokens)
        np.ascontiguousarray(tokens, dtype=self.dtype).tofile(self._data)
        self._lengths.append(sequence_lengths.astype(np.int32))
        self._document_ends.append(self._sequences + np.cumsum(np.asarray(sequences_per_document, dtype=np.int64)))
        self._sequences += len(sequence_lengths)

    def _check_range(self, tokens: np.ndarray) -> None:
        if len(tokens) and np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            low, high = int(np.min(tokens)), int(np.max(tokens))
            if low < info.min or high > info.max:
                raise MindFormersError(f"token id {high if high > info.max else low} does not fit the dataset's dtype "
                                       f"{self.dtype} ({info.min}..{info.max}); write it with a wider dtype")

    def finalize(self) -> None:
        """Write the index and give both files their final names."""
        self._data.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.concatenate([np.zeros(1, np.int64), *self._document_ends])
        with open(self._tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", VERSION, self._code, len(lengths), len(documents)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(documents.astype("<i8").tobytes())
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))

    def abort(self) -> None:
        """Close and remove the temporary files."""
        self._data.close()
        for path in (self._tmp_bin, self._tmp_idx):
            path.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
