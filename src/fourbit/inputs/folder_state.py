"""A local folder's files as the workflow planned on them, and what changed since.

A study with a local model folder (a ``path`` model) or a tokenizer folder it names
(``model.tokenizer``) is planned on those files as they are when Snakemake builds the
DAG; the download job links them into the results later, maybe hours later and on
another host (a cluster node builds the DAG again for each job it runs). So the DAG's
build records them (the local rule record_model_folder, run where the workflow started)
and, before any job uses them, the folder is compared with that record, naming each file
added, removed, resized or rewritten (``refuse_changes``; ``check_as_planned`` where
Snakemake builds the DAG again for one job).

Per file, what can be had without reading gigabytes:
- its size and modification time (``st_mtime_ns``; a rewrite sets it; ``cp -p`` and
  ``rsync -t`` keep the source's);
- for a safetensors file, the sha256 of its header (kilobytes: every tensor's name,
  dtype, shape and byte range);
- for a file of at most HASHED_BYTES, the sha256 of all of it (config.json, the
  tokenizer, a small model's weights): a rewrite with the same bytes is no change, and
  one with other bytes is seen even where its size and time were kept.

The one change not seen: a weight file above HASHED_BYTES rewritten with the same size
and header (a fine-tune saved over its base) whose modification time was put back. Seeing
it needs all its bytes hashed on every DAG build: Python's hashlib sha256 runs at 1.07
GB/s on one core of the 2-core AMD EPYC (sha_ni) this was measured on, and its disk reads
1.3 GB/s (dd iflag=direct, smollm2-135m's 538 MB model.safetensors), so llama-3.2-1b's
2.47 GB of bf16 weights would add 2.3 s to each `snakemake -n` (4 s from a cold disk)
and an 8B model's 16 GB 15 to 27 s, on the submitting host and again in every job on a
cluster node. The download job hashes every weight file anyway (fourbit-source.json), and
every record carries that hash, so such a change still shows in the results' provenance.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

from fourbit.inputs import sources
from fourbit.inputs.weight_headers import FolderError

# Files up to this size are hashed whole when the DAG is built: 64 MiB takes 60 ms at the
# 1.07 GB/s above, and holds every tokenizer and config file (Llama 3's tokenizer.json is 9 MB).
HASHED_BYTES = 64 * 2**20
CONFIG = "config.json"


def record(folder: str | Path, names: list[str]) -> dict:
    """{"path": the folder, resolved; "files": {name: {bytes, mtime_ns, sha256 or
    header_sha256}}} of the files ``names`` of ``folder`` that exist (links followed)."""
    folder = Path(folder)
    files = {}
    for name in sorted(names):
        path = folder / name
        if not path.is_file():
            continue
        stat = path.stat()
        entry = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        if stat.st_size <= HASHED_BYTES:
            entry["sha256"] = _sha256(path)
        elif name.endswith(".safetensors"):
            entry["header_sha256"] = _header_sha256(path)
        if name == CONFIG:
            entry["config"] = _json(path)  # to name the keys that change
        files[name] = entry
    return {"path": str(folder.resolve()), "files": files}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _header_sha256(path: Path) -> str:
    """sha256 of a safetensors file's length field and JSON header (fourbit.inputs.
    weight_headers reads the same bytes; a damaged header hashes like any other)."""
    with open(path, "rb") as handle:
        length_field = handle.read(8)
        length = int.from_bytes(length_field, "little")
        header = handle.read(min(length, HASHED_BYTES))
    return hashlib.sha256(length_field + header).hexdigest()


def changes(before: dict, after: dict) -> list[str]:
    """What differs between two records of one folder (``record``), one phrase per file,
    each naming the file by its full path."""
    folder = Path(before["path"])
    if before["path"] != after["path"]:
        return [f"{folder} now leads to {after['path']}"]
    found = []
    then_files, now_files = before["files"], after["files"]
    for name in sorted({*then_files, *now_files}):
        then, now = then_files.get(name), now_files.get(name)
        what = _change(folder / name, then, now)
        if what:
            found.append(f"{folder / name} ({what})")
    return found


def _change(path: Path, then: dict | None, now: dict | None) -> str | None:
    if then is None:
        return f"new, {now['bytes']:,} bytes"
    if now is None:
        return f"gone; it had {then['bytes']:,} bytes"
    same_size = then["bytes"] == now["bytes"]
    if same_size and "sha256" in then and then["sha256"] == now.get("sha256"):
        return None  # the same bytes, whatever its time says
    if path.name == CONFIG and (keys := _config_keys(then, now)):
        return keys
    if not same_size:
        return f"{then['bytes']:,} bytes then, {now['bytes']:,} now"
    if "sha256" in then:
        return f"rewritten with other contents, the same {now['bytes']:,} bytes"
    if then.get("header_sha256") != now.get("header_sha256"):
        return (f"rewritten: the same {now['bytes']:,} bytes, but another safetensors header "
                "(other tensor names, shapes, dtypes or byte ranges)")
    if then["mtime_ns"] != now["mtime_ns"]:
        return (f"rewritten: the same {now['bytes']:,} bytes and header, but modified "
                f"{_time(now['mtime_ns'])}, where it was {_time(then['mtime_ns'])}; whether "
                "its tensors' values changed would take reading all of it")
    return None


def _json(path: Path) -> object:
    """The file's JSON, or None where it is none."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _config_keys(then: dict, now: dict) -> str | None:
    """config.json's keys that differ ("key then, key now"), from the contents each record
    keeps of it (``config`` in its entry); None where either is not a JSON object, or
    only its formatting changed."""
    before, after = then.get("config"), now.get("config")
    if not isinstance(before, dict) or not isinstance(after, dict):
        return None
    keys = sorted(k for k in {*before, *after} if before.get(k) != after.get(k))
    shown = ", ".join(f"{k} {_value(before, k)} then, {_value(after, k)} now" for k in keys[:3])
    more = f", and {len(keys) - 3} more keys" if len(keys) > 3 else ""
    return shown + more if keys else None


def _value(config: dict, key: str) -> str:
    return repr(config[key]) if key in config else "absent"


def _time(mtime_ns: int) -> str:
    """A modification time, to the nanosecond the filesystem keeps, in UTC."""
    seconds, nanoseconds = divmod(mtime_ns, 10**9)
    moment = datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    return f"{moment}.{nanoseconds:09d} UTC"


def local_state(spec: dict) -> dict | None:
    """The model's local files as the DAG's build finds them: {"model": the model folder's
    linked files, "tokenizer": the tokenizer files of the folder model.tokenizer names},
    each a fourbit.inputs.folder_state.record, the parts the study has; None when it has
    no local folder (a Hub model without model.tokenizer, the builtin and synthetic ones)."""
    state = {}
    folder = sources.source_of(spec).folder(spec)
    if folder is not None:
        state["model"] = record(folder, sources.linked_files(folder, spec))
    tokenizer = sources.named_tokenizer(spec)
    if tokenizer is not None:
        state["tokenizer"] = record(tokenizer, sources.tokenizer_names(tokenizer))
    return state or None


FOLDER_ROLES = {"model": "the model folder", "tokenizer": "the tokenizer folder (model.tokenizer)"}


def refuse_changes(spec: dict, planned: dict, recorded_in: str, now: dict | None = None) -> None:
    """FolderError naming each file of the model's local folders added, removed, resized
    or rewritten since ``planned`` (``local_state`` when the DAG was built, which
    ``recorded_in`` names); ``now``: their state now, if taken already."""
    now = now if now is not None else local_state(spec) or {}
    found, changed = [], []
    for part, role in FOLDER_ROLES.items():
        before, after = planned.get(part), now.get(part)
        if before is None and after is None:
            continue
        if before is None or after is None:
            found.append(f"{role} was {before['path'] if before else 'none'} then, "
                         f"{after['path'] if after else 'none'} now")
            changed.append(role)
            continue
        phrases = changes(before, after)
        if phrases:
            found += phrases
            changed.append(f"{role} {before['path']}")
    if found:
        raise FolderError(
            f"{' and '.join(changed)} changed after the workflow built its DAG: "
            f"{'; '.join(found)}. The study was planned on the files as they were "
            f"({recorded_in}): put them back as they were, or start the workflow again to "
            "plan on them as they are")


def check_as_planned(spec: dict, config: dict, records: list[Path]) -> None:
    """Where Snakemake builds the DAG again for one job (a cluster node): FolderError
    naming what changed in the model's local folders since the build where the workflow
    started recorded them, in the first of ``records`` (record_model_folder files, the
    likeliest first) that records these same folders; with no such record, the folders
    checked whole (``check_local_folder``). Unchanged, they passed that check there."""
    now = local_state(spec)
    if now is None:
        return
    folders = {part: entry["path"] for part, entry in now.items()}
    for path in records:
        try:
            planned = json.loads(Path(path).read_text())
            recorded = {part: entry["path"] for part, entry in planned.items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue  # not a record this build can read: another one may be
        if recorded == folders:
            refuse_changes(spec, planned, f"recorded in {path} when the DAG was built", now)
            return
    sources.check_local_folder(spec, config)
