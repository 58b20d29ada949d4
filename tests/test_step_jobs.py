"""Steps over HTTP (``steps.jobs``, ``actors.http_errors``): a POST starts or joins a step, a GET
says how it stands; a second step of the same kind while one runs is a conflict; errors map to
one JSON shape with a status that says what went wrong."""

import asyncio
import json

import pytest
from conftest import run

from rayapp.core.termination import EngineConnectionError
from rayapp.steps.jobs import StepConflict, StepJobs


def test_a_job_runs_once_is_joined_and_reports_its_state():
    async def go():
        jobs, runs, gate = StepJobs(keep=2), [], asyncio.Event()

        async def step(i):
            runs.append(i)
            await gate.wait()
            if i == 3:
                raise ValueError("bad step")
            return f"result {i}"

        job = jobs.start("rollout", 1, lambda: step(1))
        assert jobs.start("rollout", 1, lambda: step(1)) is job and job.state == "running"
        await asyncio.sleep(0)
        with pytest.raises(StepConflict, match="rollout 1 is in flight"):
            jobs.start("rollout", 2, lambda: step(2))
        other = jobs.start("eval", 2, lambda: step(2))  # another kind runs beside it
        gate.set()
        await asyncio.gather(job.task, other.task)
        assert (job.state, job.result, job.error) == ("done", "result 1", None)
        assert jobs.start("rollout", 1, lambda: step(1)) is job  # done: joined, not run again
        failed = jobs.start("rollout", 3, lambda: step(3))
        await asyncio.wait([failed.task])
        assert failed.state == "failed" and isinstance(failed.error, ValueError)
        again = jobs.start("rollout", 3, lambda: step(3))  # a failed step runs afresh when asked again
        assert again is not failed
        await asyncio.wait([again.task])
        assert runs == [1, 2, 3, 3]
        cancelled = jobs.start("rollout", 4, lambda: asyncio.sleep(60))
        cancelled.task.cancel()
        await asyncio.wait([cancelled.task])
        assert cancelled.state == "cancelled" and cancelled.error is None
        assert jobs.get("rollout", 1) is None and jobs.get("rollout", 3) is again  # only the latest two kept
        assert jobs.get("rollout", 9) is None

    run(go())


@pytest.mark.parametrize("error, status", [
    (ValueError("rollout_id must be an int"), 422), (EngineConnectionError("engine student unreachable"), 503),
    (RuntimeError("x" * 5000), 500)])
def test_errors_are_json_with_a_status_that_says_what_went_wrong(error, status):
    pytest.importorskip("fastapi")
    from rayapp.actors.http_errors import exception_response

    answer = exception_response(error)
    body = json.loads(answer.body)
    assert answer.status_code == status and body["status"] == status
    assert body["error"] == type(error).__name__ and len(body["message"]) < 2100
