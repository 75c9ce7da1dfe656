"""A model folder's safetensors files, read from their headers alone: which tensors, in
which dtype and shape, in which file; refused, naming the file, when a header would make
safetensors itself fail later inside a job.

The safetensors layout (https://github.com/huggingface/safetensors, "Format"): an 8-byte
little-endian header length N, N bytes of UTF-8 JSON ({tensor name: {"dtype", "shape",
"data_offsets": [begin, end]}}, plus an optional "__metadata__"), then the data. Offsets
count from the first byte after the header; safetensors refuses a file unless the
tensors tile the data exactly: each begins where the one before ends, and the last ends
at the end of the file ("incomplete metadata, file not fully covered" otherwise). A file
of 1 GB of data with 20 tensors costs one read of its few-kilobyte header here, so these
checks run while the workflow builds its DAG. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from fourbit.schema import ConfigError

INDEX = "model.safetensors.index.json"  # a sharded checkpoint's {tensor: shard} map
# The dtypes fourbit reads as a dense source model, with their bytes per element: the
# untie step and the quantizers load any of them as floats (fourbit.checkpoints.hf).
DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
ALLOWED = "F32, F16 and BF16"
# safetensors' own cap on a header (MAX_HEADER_SIZE in its Rust source): a bigger length
# field is not a safetensors file.
MAX_HEADER_BYTES = 100_000_000
RECOPY = "copy it again from where the model came from"


class FolderError(ConfigError):
    """A model folder fourbit cannot use, naming the file, what is wrong and what is right."""


@dataclass(frozen=True)
class Tensor:
    file: str  # the weight file's name in the folder
    dtype: str
    shape: tuple[int, ...]


def read_tensors(folder: Path) -> dict[str, Tensor]:
    """Every tensor of the folder's *.safetensors files, by name, from their headers;
    FolderError naming the file when a header, a byte range, a dtype or the shard index
    is wrong, or when two files hold one tensor."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FolderError(f"{folder}: no *.safetensors weights; fourbit loads safetensors only "
                          "(convert with save_pretrained(..., safe_serialization=True))")
    tensors: dict[str, Tensor] = {}
    for path in files:
        for name, tensor in read_header(path).items():
            if name in tensors:
                raise FolderError(
                    f"{folder}: tensor {name} is in both {tensors[name].file} and {path.name}; "
                    "each tensor must be in one weight file (remove the file that is not part "
                    "of this model)")
            tensors[name] = tensor
    check_index(folder, tensors)
    return tensors


def read_header(path: Path) -> dict[str, Tensor]:
    """One file's tensors; FolderError naming ``path`` unless safetensors would load it."""
    if not path.is_file():
        raise FolderError(f"{path}: not a readable file (a link to a file that is gone?); {RECOPY}")
    size = path.stat().st_size
    if size < 8:
        what = "is empty (0 bytes)" if size == 0 else f"is {size} bytes long"
        raise FolderError(f"{path} {what}: a safetensors file starts with an 8-byte header "
                          f"length and a JSON header; {RECOPY}")
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise FolderError(
                f"{path}: its first 8 bytes give a header of {length:,} bytes, but the file is "
                f"{size:,} bytes long: it is truncated, or not a safetensors file; {RECOPY}")
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FolderError(f"{path}: its header is not UTF-8 JSON ({error}); the file is damaged "
                          f"or not a safetensors file; {RECOPY}") from None
    if not isinstance(header, dict):
        raise FolderError(f"{path}: its header is JSON but not an object of tensors; {RECOPY}")
    header.pop("__metadata__", None)
    tensors = {name: _entry(path, name, entry) for name, entry in header.items()}
    _check_ranges(path, header, size - 8 - length)
    return tensors


def _entry(path: Path, name: str, entry: object) -> Tensor:
    """One header entry as a Tensor, once its dtype and its byte count agree with its shape."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        valid = (isinstance(dtype, str) and all(isinstance(n, int) and n >= 0 for n in shape)
                 and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end)
    except (TypeError, KeyError, ValueError):
        valid = False
    if not valid:
        raise FolderError(f"{path}: header entry {name!r} is not a tensor (dtype, shape, "
                          f"data_offsets [begin, end]): {str(entry)[:200]}; {RECOPY}")
    if dtype not in DTYPES:
        raise FolderError(
            f"{path}: tensor {name} is {dtype}; fourbit reads dense weights in {ALLOWED} only "
            "(it quantizes the model itself, so a quantized or FP8 checkpoint is no starting "
            "point): use the model's F32, F16 or BF16 release")
    expected = math.prod(shape) * DTYPES[dtype]
    if end - begin != expected:
        raise FolderError(
            f"{path}: tensor {name} ({dtype}, shape {list(shape)}) takes {expected:,} bytes, but "
            f"its data_offsets span {end - begin:,}; the header is damaged; {RECOPY}")
    return Tensor(path.name, dtype, tuple(shape))


def _check_ranges(path: Path, header: dict, data_bytes: int) -> None:
    """The tensors tile the ``data_bytes`` after the header exactly, as safetensors demands."""
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], name) for name, e in header.items())
    last_end = max((end for _, end, _ in spans), default=0)
    if last_end > data_bytes:
        cut = next(name for begin, end, name in spans if end > data_bytes)
        raise FolderError(
            f"{path} is truncated: its header places the tensors in {last_end:,} bytes after "
            f"the header, but the file holds only {data_bytes:,} ({path.stat().st_size:,} bytes "
            f"in all, {last_end - data_bytes:,} short; tensor {cut} is cut off); {RECOPY}")
    position = 0
    for begin, end, name in spans:
        if begin != position:
            how = ("overlaps the tensor before it" if begin < position
                   else "leaves a gap after the tensor before it")
            raise FolderError(
                f"{path}: tensor {name} starts at data byte {begin:,}, which {how} (ends at "
                f"{position:,}); safetensors refuses such a file; {RECOPY}")
        position = end
    if position != data_bytes:
        raise FolderError(
            f"{path}: {data_bytes - position:,} bytes after the last tensor belong to no tensor "
            "of the header (safetensors refuses it: 'file not fully covered'); the file was "
            f"appended to or written by a broken tool; {RECOPY}")


def check_index(folder: Path, tensors: dict[str, Tensor]) -> None:
    """A sharded checkpoint's index (model.safetensors.index.json) names only shards that
    are in the folder, and each tensor where its header has it (transformers loads by it)."""
    path = folder / INDEX
    if not path.is_file():
        return
    try:
        weight_map = json.loads(path.read_bytes().decode("utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise FolderError(f"{path}: not a safetensors index (UTF-8 JSON with a weight_map of "
                          f"tensor -> shard file): {error}; {RECOPY}") from None
    missing = [name for name in shards if not (folder / name).is_file()]
    if missing:
        raise FolderError(
            f"{path}: its weight_map names {', '.join(missing)}, which {folder} does not have "
            f"({len(missing)} of the {len(shards)} shards it lists); copy the missing "
            f"{'shard' if len(missing) == 1 else 'shards'} from where the model came from")
    for name, shard in sorted(weight_map.items()):
        if name not in tensors or tensors[name].file != shard:
            found = f"is in {tensors[name].file}" if name in tensors else "is in no weight file"
            raise FolderError(f"{path}: its weight_map puts {name} in {shard}, but that tensor "
                              f"{found}; the index and the shards are of different saves; {RECOPY}")
