"""A training driver's view of rayapp: connect to the running app, ask for rollout and eval steps
through the manager's handle, and print what a trainer would consume.

    python recipes/driver.py --address auto --rollouts 1 --eval

With ``--eval``, iteration k is rollout k then eval k (a DAgger recipe evaluates the student alone).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # 127.0.0.1 only on one machine


def wait_with_progress(handle, response, what: str, timeout_s: float):
    """Wait for a step with a live status line (rewritten in place on a terminal, a new line per
    change otherwise): tasks and samples done, batches running and waiting, seconds so far."""
    started, last = time.monotonic(), None
    live = sys.stdout.isatty()
    try:
        while True:
            try:
                return response.result(timeout_s=1.0)
            except TimeoutError:
                if time.monotonic() - started > timeout_s:
                    response.cancel()
                    raise TimeoutError(f"{what} did not finish within {timeout_s}s") from None
                try:
                    st = handle.status.remote().result(timeout_s=30)
                except TimeoutError:  # a busy manager's progress answer is late: only the progress line waits
                    continue
                line = (f"  {what}: {st.get('tasks_done', 0)}/{st.get('tasks', '?')} tasks, "
                        f"{st.get('samples_done', 0)} samples done, {st.get('batches_running', 0)} batches "
                        f"running, {st.get('batches_waiting', 0)} waiting")
                if live:
                    print(f"\r{line} [{time.monotonic() - started:.0f}s]\033[K", end="", flush=True)
                elif line != last:
                    print(line, flush=True)
                last = line
    finally:
        if live and last is not None:
            print(flush=True)


def show_statistics(metrics: dict, prefix: str) -> None:
    """The step's statistics per dataset, one line each (``rayapp.core.stats``)."""
    names = sorted({k.split("/")[1] for k in metrics if k.startswith(prefix + "/") and k.endswith("/n_samples")})
    for name in names:
        m = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith(f"{prefix}/{name}/")}
        reward = f"{m['reward_mean']:.3f}±{m['reward_std']:.3f}" if "reward_mean" in m else "n/a"
        print(f"  {name:<12} n={m['n_samples']:.0f} reward={reward} length={m.get('response_length_mean', 0):.1f} "
              f"truncated={m['truncated_rate']:.2f} aborted={m['abort_rate']:.2f} "
              f"wait={m.get('wait_s_mean', 0):.2f}s run={m.get('run_s_mean', 0):.2f}s "
              f"verify={m.get('verify_s_mean', 0):.2f}s")
    if f"{prefix}/samples_per_s" in metrics:
        print(f"  {metrics[f'{prefix}/samples_per_s']:.2f} samples/s; fetch {metrics[f'{prefix}/time/fetch_s']:.2f}s, "
              f"step {metrics[f'{prefix}/time/step_s']:.1f}s")


def show_rollout(result) -> None:
    samples = [s for g in result.groups for s in g]
    print(f"rollout {result.rollout_id}: {len(result.groups)} groups, {len(samples)} samples")
    for g in result.groups:
        rewards = [s.reward.get("score", 0.0) for s in g]
        reasons = sorted({str(s.metadata.get("_termination_reason")) for s in g})
        print(f"  {g[0].metadata.get('_dataset_name', '-'):<10} {g[0].task_id[:24]:<24} rewards={rewards} "
              f"turns={[s.metadata.get('_turns', 0) for s in g]} reasons={reasons} "
              f"tokens={[len(s.tokens) for s in g]} loss_mask_sums={[sum(s.loss_mask) for s in g]} "
              f"status={sorted(Counter(s.status.value for s in g).items())}")
    shown: set[str] = set()
    for s in samples:  # one sample per environment
        name = s.metadata.get("_dataset_name", "-")
        if name in shown:
            continue
        shown.add(name)
        lp = [p for p, m in zip(s.rollout_log_probs, s.loss_mask, strict=False) if m]
        print(f"  {name} sample {s.task_id}#{s.index}: response={s.response[:80]!r} mean_logprob="
              f"{(sum(lp) / len(lp)) if lp else 0.0:.3f} placed_on={s.metadata.get('_placement')}")
    from rayapp.core.termination import FailureClass

    print("  failure classes:", {c.value: result.metrics[f"rollout/{c.value}"] for c in FailureClass
                                 if result.metrics.get(f"rollout/{c.value}")})
    show_statistics(result.metrics, "rollout")
    m = result.metrics
    if "filter/kept_groups" in m:
        drops = {k.removeprefix("filter/").replace("/dropped/", ": "): int(v) for k, v in m.items()
                 if k.startswith("filter/") and "/dropped/" in k}
        print(f"  filters: kept {m['filter/kept_groups']:.0f} of {m['filter/input_groups']:.0f} groups, "
              f"{m['filter/kept_samples']:.0f} of {m['filter/input_samples']:.0f} samples; "
              f"samples dropped {drops or 'none'}; aborted share {m['filter/abort_share']:.2f}")
    show_artifacts(result)


def failure_classes(samples) -> dict[str, int]:
    """How many samples ended in each failure class (``rayapp.core.termination``), most first."""
    from rayapp.core.termination import classify_termination

    # a step's samples carry their episode's reason as the trainer reads it (``_termination_reason``)
    found = Counter(classify_termination(s.reward, s.metadata.get("_termination_reason")).value for s in samples)
    return dict(found.most_common())


def show_iteration(result) -> None:
    """What the scheduler published for this iteration, and who acted in the DAgger roll-ins."""
    it, m = result.iteration, result.metrics
    if it.rollout_id is None:  # the recipe publishes no iteration state
        return
    print(f"iteration {result.rollout_id}: beta={it.beta} t_max={it.t_max}; roll-in turns by teacher "
          f"{m.get('dagger/turns/teacher', 0):.0f}, by student {m.get('dagger/turns/student', 0):.0f}; "
          f"teacher labels for student turns {m.get('dagger/labels', 0):.0f}")


_SAID: set[str] = set()


def show_artifacts(result) -> None:
    for kind, path in sorted(result.artifacts.items()):
        print(f"  artifact {kind:<14} {path}")
    if "timeline" in result.artifacts and "timeline_png" not in result.artifacts and "png" not in _SAID:
        _SAID.add("png")  # once a run: every step would say the same
        print("  no timeline PNG: matplotlib is not installed where the app runs (the 'plot' extra: "
              "pip install 'rayapp[plot]'); the trace above opens in https://ui.perfetto.dev", flush=True)


def show_placement(result) -> None:
    where = Counter((s.metadata.get("_placement") or {}).get("node", "-") for g in result.groups for s in g)
    gpus = Counter(tuple((s.metadata.get("_placement") or {}).get("gpu_ids", [])) for g in result.groups for s in g)
    print(f"placement: samples per node {dict(where)}, per GPU {dict(gpus)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="auto",
                   help="the Ray cluster to connect to (default: auto, the one running on this machine)")
    p.add_argument("--app", default="rayapp", help="the Serve application's name in the recipe (default: rayapp)")
    p.add_argument("--rollouts", type=int, default=1, help="rollout steps to ask for, ids 0..N-1 (default: 1)")
    p.add_argument("--eval", action="store_true", help="after rollout k, ask for eval step k too")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds a step may take before the driver cancels it (default: 900)")
    p.add_argument("--wait", type=float, default=300.0,
                   help="seconds to wait for the app's manager to come up, right after serve run (default: 300)")
    p.add_argument("--tensorboard", metavar="DIR", help="also write each step's metrics to TensorBoard in DIR "
                   "(the tensorboard extra)")
    p.add_argument("--wandb", metavar="PROJECT", help="also log each step's metrics to this wandb project "
                   "(the wandb extra; WANDB_MODE=offline without a network)")
    p.add_argument("--verbose", action="store_true", help="Ray's and Serve's lines of this process on the "
                   "terminal (Ray's banner, Serve's router); the replicas' are in serve run's output")
    a = p.parse_args()
    from rayapp.trainers.metric_sinks import open_sink

    sinks = [open_sink(kind, target) for kind, target in (("tensorboard", a.tensorboard), ("wandb", a.wandb))
             if target]

    import ray

    from rayapp import connect

    handle = connect(a.address, a.app, namespace="rayapp-driver", verbose=a.verbose, worker_logs=False,
                     timeout_s=a.wait)
    for rid in range(a.rollouts):
        t0 = time.monotonic()
        result = wait_with_progress(handle, handle.generate.remote(rid), f"rollout {rid}", a.timeout)
        show_iteration(result)
        print(f"[{time.monotonic() - t0:.1f}s] ", end="")
        show_rollout(result)
        show_placement(result)
        for sink in sinks:
            sink.log(rid, result.metrics)
        if a.eval:
            t0 = time.monotonic()
            ev = wait_with_progress(handle, handle.evaluate.remote(rid), f"eval {rid}", a.timeout)
            beta = f" (beta={ev.iteration.beta})" if ev.iteration.rollout_id is not None else ""
            print(f"[{time.monotonic() - t0:.1f}s] eval {rid}{beta}:")
            for k, v in sorted(ev.metrics.items()):
                if k.endswith(("/accuracy", "/n_samples")) or "/pass@" in k:
                    print(f"  {k:<28} {v:.3f}")
            print("  failure classes:", failure_classes([s for ss in ev.samples.values() for s in ss]))
            show_statistics(ev.metrics, "eval")
            show_artifacts(ev)
            for sink in sinks:
                sink.log(rid, ev.metrics)
    for sink in sinks:
        sink.close()
    ray.shutdown()


if __name__ == "__main__":
    main()
