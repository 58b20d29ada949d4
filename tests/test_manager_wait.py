"""A driver that asks right after ``serve run`` starts (issue 32, point 2): before the rayapp
application exists, or while its manager deployment has no replica, Serve answers "does not exist"
or ``DeploymentUnavailableError`` at once. ``connect`` and the trainer adapters first wait for the
manager (``rayapp.connection.wait_for_manager``), saying its state as it changes, and after their
bound fail with one line naming the app, the deployment and its state. Over scripted answers of
``serve.status()`` built from Serve's own status classes, on a scripted clock (no cluster)."""

import pytest
from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger
from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

from rayapp.connection import MANAGER, manager_handle, manager_state, next_pause, wait_for_manager


def serve_status(app: str | None, deployments: dict[str, DeploymentStatus] | None = None,
                 status: ApplicationStatus = ApplicationStatus.DEPLOYING, message: str = "") -> ServeStatus:
    """What ``serve.status()`` answers while ``app`` (None: no application) deploys ``deployments``."""
    if app is None:
        return ServeStatus()
    overview = ApplicationStatusOverview(status=status, message=message, last_deployed_time_s=10.0, deployments={
        name: DeploymentStatusOverview(status=state, status_trigger=DeploymentStatusTrigger.CONFIG_UPDATE_STARTED,
                                       replica_states={}, message=message if state.value == "DEPLOY_FAILED" else "")
        for name, state in (deployments or {}).items()})
    return ServeStatus(applications={app: overview})


class Script:
    """``serve.status()`` answering ``answers`` in turn (the last one for ever), on a clock that only
    the waiter's pauses move."""

    def __init__(self, *answers: ServeStatus):
        self.answers, self.asked, self.now, self.pauses, self.said = list(answers), 0, 0.0, [], []

    def status(self) -> ServeStatus:
        self.asked += 1
        return self.answers[min(self.asked, len(self.answers)) - 1]

    def sleep(self, s: float) -> None:
        self.pauses.append(s)
        self.now += s

    def wait(self, app: str = "rayapp", timeout_s: float = 300.0) -> None:
        wait_for_manager(app, timeout_s, status=self.status, say=self.said.append, sleep=self.sleep,
                         clock=lambda: self.now)


UPDATING, HEALTHY = DeploymentStatus.UPDATING, DeploymentStatus.HEALTHY


def test_a_driver_waits_for_the_manager_saying_each_new_state_then_goes_on():
    script = Script(serve_status(None), serve_status(None),
                    serve_status("rayapp", {"PlacementPoolService": UPDATING}),
                    serve_status("rayapp", {"PlacementPoolService": HEALTHY, "engine-student": UPDATING,
                                            MANAGER: UPDATING}),
                    serve_status("rayapp", {"PlacementPoolService": HEALTHY, "engine-student": UPDATING,
                                            MANAGER: UPDATING}),
                    serve_status("rayapp", {"PlacementPoolService": HEALTHY, "engine-student": UPDATING,
                                            MANAGER: HEALTHY}))
    script.wait()
    assert script.asked == 6 and script.pauses == [0.5, 1.0, 2.0, 5.0, 5.0]
    assert script.said == [
        "waiting for the rayapp app's manager: no such application yet (0 s)",
        f"waiting for the rayapp app's manager: application DEPLOYING, {MANAGER} not deployed yet (2 s)",
        "waiting for the rayapp app's manager: UPDATING (application DEPLOYING) (4 s)"]


def test_a_running_application_is_up_whatever_its_ingress_is_called():
    script = Script(serve_status("hello", {"Hello": HEALTHY}, status=ApplicationStatus.RUNNING))
    script.wait("hello")
    assert script.asked == 1 and script.said == []


def test_after_its_bound_the_wait_is_one_line_naming_the_app_the_deployment_and_its_state():
    script = Script(serve_status("rayapp", {MANAGER: UPDATING, "engine-student": UPDATING}))
    with pytest.raises(TimeoutError) as e:
        script.wait(timeout_s=20)
    assert str(e.value) == (f"the rayapp app's manager ({MANAGER}) is not up within 20s: UPDATING "
                            "(application DEPLOYING); see `serve status`")
    assert sum(script.pauses) < 20


def test_a_manager_that_failed_to_deploy_fails_the_wait_at_once_with_its_error():
    failed = "Traceback (most recent call last):\n  ...\nModuleNotFoundError: No module named 'my_agents'"
    script = Script(serve_status("rayapp", {MANAGER: DeploymentStatus.DEPLOY_FAILED},
                                 status=ApplicationStatus.DEPLOY_FAILED, message=failed))
    with pytest.raises(RuntimeError) as e:
        script.wait()
    assert str(e.value) == (f"the rayapp app's manager ({MANAGER}) will not come up: application DEPLOY_FAILED, "
                            f"deployment DEPLOY_FAILED: ModuleNotFoundError: No module named 'my_agents'")
    assert script.asked == 1


def test_the_manager_is_ready_while_serve_scales_it():
    for state in (DeploymentStatus.UPSCALING, DeploymentStatus.DOWNSCALING):
        assert manager_state(serve_status("rayapp", {MANAGER: state}), "rayapp") == (True, state.value)
    assert manager_state(serve_status("rayapp", {MANAGER: DeploymentStatus.UNHEALTHY}), "rayapp") == (
        False, "UNHEALTHY (application DEPLOYING)")


def test_the_pauses_grow_and_never_end_past_the_bound():
    assert [next_pause(i, 60) for i in range(6)] == [0.5, 1.0, 2.0, 5.0, 5.0, 5.0]
    assert next_pause(3, 5.0) is None and next_pause(0, 0.4) is None


def test_manager_handle_takes_no_handle_before_the_manager_is_up():
    """Serve's ``get_app_handle`` is not reached (it would answer "does not exist"): the wait's error is."""
    never = Script(serve_status(None))
    with pytest.raises(TimeoutError, match=r"^the rayapp app's manager \(SchedulerRolloutManager\) is not up within "
                                           r"0.3s: no such application yet; see `serve status`$"):
        manager_handle("rayapp", 0.3, status=never.status, say=None)
