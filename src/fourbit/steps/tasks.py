"""workflow/rules/tasks.smk: rule tasks (tasks_study). Does each build still solve the
problems its model solves? Greedy completions of every enabled task set (fourbit.tasks)
from each build's real OpenAI-compatible server, checked in the sandbox.

One job for the study, like the serve job: it takes every core, and one server at a time
holds them. For each served arm (the serve step's choice, fourbit.steps.serve.choose_arms,
with each engine's baseline always: every arm is paired against it): start the arm's
server (fourbit.serving), send every problem's request, ``tasks.slots`` in flight (the
server batches them in as many slots), collect the completions, stop the server, then run
the task's checker on them in the sandbox, as many at a time as the job has cores. The
server is stopped before checking, so model-written code never runs beside a server.

Refused, not failed: an arm its engine cannot run here, or a GGUF llama-server will not
load (as in the serve step); its entry says why. Failed: a server that exits or never
answers, a request it answers with an error, the sandbox or the task's data: the job
stops with the reason, every server is stopped, and no tasks.json is written.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from fourbit import records
from fourbit.bench.pinning import choose_cores, pinned
from fourbit.engines import get_engine
from fourbit.hashing import require_sha256
from fourbit.metrics.passrate import paired, pass_at_1
from fourbit.schema import block
from fourbit.serving.process import RunningServer, ServerError, exit_on_sigterm, running_server
from fourbit.serving.registry import launch
from fourbit.steps.llamacpp import load_tools
from fourbit.steps.serve import BASELINE, ServedArm, choose_arms
from fourbit.tasks import scoring
from fourbit.tasks.preflight import enabled
from fourbit.tasks.registry import Problem, PromptFormat, Task, TaskError, get

log = logging.getLogger("fourbit")

REQUEST_TIMEOUT_S = 3600.0  # one completion on a loaded 2-core host takes seconds to minutes


def tasks_study(arms: list[ServedArm], tasks_settings: dict, serve_settings: dict,
                bench_settings: dict, *, out: Path, server_logs: Path, threads: int,
                model_weights_sha256: str, control_tolerance: dict,
                positions: int | None = None, llamacpp_tools: Path | None = None) -> dict:
    """Score the chosen ``arms`` on every task ``tasks_settings`` enables (see the module
    docstring), write tasks.json to ``out``, return it. ``serve_settings`` choose the
    arms and give the servers' start-up timeout; ``bench_settings`` the cores;
    ``server_logs`` the folder each server's own log goes to; ``positions`` the model's
    (config.json's max_position_embeddings), which bound each request's context."""
    require_sha256(model_weights_sha256)
    settings = block("tasks", tasks_settings)
    serve = block("serve", serve_settings)
    cores = choose_cores(block("bench", bench_settings)["cores"], threads)
    tasks = [get(name) for name in enabled(settings)]
    if not tasks:
        raise TaskError("the tasks step runs with no task enabled; enable one under tasks: "
                        "(e.g. humaneval: true) or leave the step out")
    arms = [ServedArm(**{**vars(a), "model": Path(a.model)}) for a in arms]
    # Every arm is paired against its engine's baseline, whatever serve.baseline says.
    chosen = choose_arms(arms, {**serve, "baseline": True}, control_tolerance)
    context = _context_tokens(settings["context_tokens"], positions)
    # The work each task asks, chosen and checked before any server starts.
    work = [(task, _problems(task, settings["problems"]), _prompt_format(task, settings["max_tokens"]))
            for task in tasks]
    llamacpp_server = load_tools(llamacpp_tools).server if llamacpp_tools else None
    started = datetime.now(UTC).isoformat(timespec="seconds")
    results = []
    with exit_on_sigterm(), pinned(cores):
        for task, problems, prompt_format in work:
            entries = [_score_arm(arm, task, problems, prompt_format, slots=settings["slots"],
                                  context=context, cores=cores, server_logs=Path(server_logs),
                                  startup_timeout_s=serve["startup_timeout_s"],
                                  llamacpp_server=llamacpp_server)
                       for arm in chosen]
            _pair_with_baselines(entries)
            results.append({"task": task.name, "source": task.source,
                            "prompt_format": _stated(prompt_format),
                            "problems": [p.id for p in problems], "arms": entries})
    record = {
        "model_weights_sha256": model_weights_sha256,
        "job": {"started": started, "slots": settings["slots"], "context_tokens": context,
                "cores": cores, "checking_parallel": len(cores)},
        "tasks": results,
    }
    records.write("tasks", out, record)
    return record


def _problems(task: Task, wanted: int | list[str] | None) -> list[Problem]:
    """The problems tasks.problems selects, in the task's order."""
    problems = task.load()
    if wanted is None:
        return problems
    if isinstance(wanted, int):
        return problems[:wanted]
    known = {p.id for p in problems}
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise TaskError(f"tasks.problems names {unknown[:5]}, which are not problems of "
                        f"{task.name!r} (its ids look like {problems[0].id!r})")
    return [p for p in problems if p.id in set(wanted)]


def _prompt_format(task: Task, max_tokens: int | None) -> PromptFormat:
    fmt = task.prompt_format
    if max_tokens is None:
        return fmt
    return PromptFormat(fmt.chat_template, fmt.stop, max_tokens, fmt.temperature)


def _stated(fmt: PromptFormat) -> dict:
    return {"chat_template": fmt.chat_template, "stop": list(fmt.stop), "max_tokens": fmt.max_tokens,
            "temperature": fmt.temperature}


def _context_tokens(wanted: int, positions: int | None) -> int:
    """tasks.context_tokens, lowered to the model's positions (a server refuses a longer
    context, or computes positions the model never learnt)."""
    return wanted if positions is None else min(wanted, positions)


def _score_arm(arm: ServedArm, task: Task, problems: list[Problem], fmt: PromptFormat, *,
               slots: int, context: int, cores: list[int], server_logs: Path,
               startup_timeout_s: float, llamacpp_server: Path | None) -> dict:
    """One arm's entry: its completions from its server, then their checks."""
    entry = {"engine_id": arm.engine_id, "engine": arm.engine["name"], "arm": arm.arm,
             "arm_name": arm.arm_name, "model": str(arm.model)}
    if arm.refusal:
        log.info("%s: refused (%s)", arm.key, arm.refusal)
        return entry | {"status": "refused", "reason": arm.refusal}
    log_path = server_logs / f"{task.name}.{arm.engine_id}.{arm.arm}.log"
    start = launch(arm.key, arm.engine, arm.model, served_name=arm.arm_name, slots=slots,
                   tokens_per_request=context, cores=cores, cache_root=arm.cache,
                   llamacpp_server=llamacpp_server)
    server_kind, port, command = start.kind, start.port, start.command
    entry |= {"command": command.argv, "server_log": str(log_path)}
    try:
        with running_server(arm.key, command.argv, command.env, port, log_path,
                            health_path=server_kind.health_path,
                            startup_timeout_s=startup_timeout_s) as server:
            log.info("%s: answering after %.1f s; %d %s problems, %d in flight", arm.key,
                     server.startup_s, len(problems), task.name, slots)
            start = time.monotonic()
            completions = complete(server, arm.arm_name, problems, fmt, slots=slots,
                                   extra_body=dict(server_kind.extra_body))
            generation_s = time.monotonic() - start
    except ServerError:
        reason = server_kind.refusal(log_path)
        if reason is None:
            raise
        log.info("%s: refused (%s)", arm.key, reason)
        return entry | {"status": "refused", "reason": reason}
    scores = scoring.score(task, completions, parallel=len(cores))
    rate = pass_at_1(scores.passed())
    log.info("%s: pass@1 %d/%d, generation %.1f s, checking %.1f s", arm.key, rate.solved,
             rate.problems, generation_s, scores.wall_seconds)
    return entry | {
        "status": "measured",
        "runtime": f"{get_engine(arm.engine['name']).runtime(arm.model, arm.engine)}, "
                   f"served by {server_kind.label}",
        "startup_s": server.startup_s,
        "generation_s": generation_s,
        "checking_s": scores.wall_seconds,
        "pass_at_1": {"value": rate.value, "solved": rate.solved, "problems": rate.problems,
                      "lower": rate.lower, "upper": rate.upper},
        "outcomes": {pid: vars(outcome) for pid, outcome in scores.outcomes.items()},
        "completions": completions,
        "vs_baseline": None,
    }


def complete(server: RunningServer, served_name: str, problems: list[Problem], fmt: PromptFormat,
             *, slots: int, extra_body: dict) -> dict[str, str]:
    """{problem id: completion} from ``server``, ``slots`` requests in flight. A request the
    server answers with an error, or a server that dies, raises ServerError with its log."""
    def one(problem: Problem) -> str:
        path, body = fmt.request(problem.prompt)
        body = {"model": served_name, **body, **extra_body}
        request = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as error:
            server.check_alive()
            raise server.failure(f"{problem.id}: the server answered {error.code}: "
                                 f"{error.read().decode(errors='replace')[:500]}") from error
        except (urllib.error.URLError, OSError) as error:
            server.check_alive()  # a dead server is the cause to name
            raise server.failure(f"{problem.id}: {error}") from error
        choice = answer["choices"][0]
        return fmt.cut(choice["message"]["content"] if fmt.chat_template else choice["text"])

    with ThreadPoolExecutor(max_workers=slots) as pool:
        texts = list(pool.map(one, problems))
    server.check_alive()
    return {problem.id: text for problem, text in zip(problems, texts)}


def _pair_with_baselines(entries: list[dict]) -> None:
    """Each measured arm against its engine's measured baseline, on the same problems."""
    passed = {(e["engine_id"], e["arm"]): {pid: o["status"] == "passed" for pid, o in e["outcomes"].items()}
              for e in entries if e["status"] == "measured"}
    for entry in entries:
        baseline = passed.get((entry["engine_id"], BASELINE))
        if entry["status"] != "measured" or entry["arm"] == BASELINE or baseline is None:
            continue
        comparison = paired(passed[(entry["engine_id"], entry["arm"])], baseline)
        entry["vs_baseline"] = {"delta_pass_at_1": comparison.delta,
                                "newly_failed": comparison.newly_failed,
                                "newly_passed": comparison.newly_passed,
                                "mcnemar_p": comparison.p_value}
