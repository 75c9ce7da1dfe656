"""fourbit.bench.starts: a group's engines all launch before any is awaited, every start
ends before the group's passes, and an optional engine's failed start is its refusal."""

from __future__ import annotations

import contextlib

import pytest

from fourbit.bench.starts import open_group


class Worker:
    """A pass runner whose engine starts in the background, as vLLM's held-open worker."""

    def __init__(self, key: str, events: list, fail: bool = False):
        self.key, self.events, self.fail = key, events, fail

    def wait_ready(self):
        self.events.append(("ready", self.key))
        if self.fail:
            raise RuntimeError(f"{self.key}: engine core failed to compile")


def opener(key: str, events: list, **worker):
    @contextlib.contextmanager
    def open_it():
        events.append(("launch", key))
        yield Worker(key, events, **worker)
        events.append(("close", key))
    return open_it


def test_every_engine_launches_before_any_is_awaited_and_all_are_open_before_it_returns():
    events = []
    with contextlib.ExitStack() as stack:
        runs = open_group(stack, {k: opener(k, events) for k in ("arm", "baseline", "variant")},
                          optional={"variant"}, failed={})
        assert events == [("launch", "arm"), ("launch", "baseline"), ("launch", "variant"),
                          ("ready", "arm"), ("ready", "baseline"), ("ready", "variant")]
        assert [run.key for run in runs.values()] == ["arm", "baseline", "variant"]
    assert [e for e in events if e[0] == "close"] == [("close", "variant"), ("close", "baseline"),
                                                       ("close", "arm")]


def test_a_runner_that_starts_in_the_foreground_is_taken_as_it_comes():
    with contextlib.ExitStack() as stack:
        runs = open_group(stack, {"llama": lambda: contextlib.nullcontext("timed per pass")},
                          optional=set(), failed={})
    assert runs == {"llama": "timed per pass"}


def test_an_optional_engine_that_fails_to_start_is_refused_and_any_other_fails_the_job():
    events, failed = [], {}
    with contextlib.ExitStack() as stack:
        runs = open_group(stack, {"arm": opener("arm", events),
                                  "variant": opener("variant", events, fail=True),
                                  "other": lambda: _raises("other variant: no such kernel")},
                          optional={"variant", "other"}, failed=failed)
    assert runs["variant"] is None and runs["other"] is None and runs["arm"].key == "arm"
    assert failed == {"variant": "its engine failed to start: RuntimeError: variant: engine core "
                                 "failed to compile",
                      "other": "its engine failed to start: RuntimeError: other variant: no such kernel"}
    assert ("close", "variant") in events  # a failed start is still closed with the group
    with pytest.raises(RuntimeError, match="arm: engine core failed to compile"):
        with contextlib.ExitStack() as stack:
            open_group(stack, {"arm": opener("arm", [], fail=True)}, optional=set(), failed={})


def _raises(message: str):
    raise RuntimeError(message)
