"""rayapp: a Ray-native rollout scheduler for agentic RL training of language models.

The public API, re-exported from the pure core (``rayapp.core``), the data model, the agents and the
training-loop pieces that need neither Ray nor torch (the DAgger schedule and agent, the filters), and
``connect``, a driver's quiet ``ray.init`` and app handle (it imports Ray only when called)."""

from rayapp.connection import connect
from rayapp.core.agent import AgentHandler, FunctionAgent
from rayapp.core.batching import (
    STRATEGIES,
    BatchingStrategy,
    budget_batching,
    fifo_batching,
    longest_first_batching,
)
from rayapp.core.cascade import CascadeError, build_sampling_params, cascade, resolve_stopping
from rayapp.core.clock import run_virtual
from rayapp.core.contracts import EvalResult, RolloutResult, SchedulerConfig, StepState, StepStatus
from rayapp.core.evaluator import Evaluator, TaskRun
from rayapp.core.layout import LayoutError, parse_cluster_layout
from rayapp.core.pool import HeldBatch, PlacementPool, PoolError, Reservations, budget_tokens
from rayapp.core.scheduler import DeadlockError, TaskScheduler, interleave
from rayapp.core.step_metrics import eval_metrics, failure_summary, pass_at_k
from rayapp.core.termination import (
    SOLVED_SCORE,
    AbortReason,
    AgentOutputError,
    AgentTimeout,
    EngineConnectionError,
    EpisodeError,
    FailureClass,
    SandboxError,
    classify_abort,
    classify_termination,
    is_solved,
)
from rayapp.envs.agents.chat import ChatAgent
from rayapp.envs.agents.dagger import DAggerAgent, DAggerRollIn
from rayapp.envs.agents.gym import GymAgent, skyrl_gym_env
from rayapp.envs.agents.multiturn import ToolAgent
from rayapp.envs.datasets import DatasetError, DatasetSpec, MultiDataSource
from rayapp.envs.datasets.files import FieldMap
from rayapp.envs.plugin_import import PluginError, load_strategy
from rayapp.envs.protocol import AgentDeps, Env
from rayapp.envs.sandboxes import DockerSandbox, LocalProcessSandbox, SandboxLimits, make_sandbox
from rayapp.episode import EpisodeContext
from rayapp.record import EpisodePhase, EpisodeRecord, Iteration, TerminationReason
from rayapp.steps.artifacts import read_jsonl
from rayapp.steps.dagger_schedule import DAggerIterations, DAggerSchedule, add_dagger_args, roll_in_metrics
from rayapp.steps.filters import AbortCap, FinishOnlyFilter, RejectionFilter, apply_filters
from rayapp.steps.partial import PartialConfig, PartialRollouts
from rayapp.trainers.step_tasks import tasks_from_rows
from rayapp.types import (
    AgentResult,
    Batch,
    BatchRequest,
    EvaluatorSpec,
    NodeSpec,
    Resource,
    Sample,
    SamplingParams,
    Status,
    StepKind,
    StoppingCriteria,
    Task,
    TaskConfig,
    TaskKey,
    Token,
)

__all__ = [
    "SOLVED_SCORE",
    "STRATEGIES",
    "AbortCap",
    "AbortReason",
    "AgentDeps",
    "AgentHandler",
    "AgentOutputError",
    "AgentResult",
    "AgentTimeout",
    "Batch",
    "BatchRequest",
    "BatchingStrategy",
    "CascadeError",
    "ChatAgent",
    "DAggerAgent",
    "DAggerIterations",
    "DAggerRollIn",
    "DAggerSchedule",
    "DatasetError",
    "DatasetSpec",
    "DeadlockError",
    "DockerSandbox",
    "EngineConnectionError",
    "Env",
    "EpisodeContext",
    "EpisodeError",
    "EpisodePhase",
    "EpisodeRecord",
    "EvalResult",
    "Evaluator",
    "EvaluatorSpec",
    "FailureClass",
    "FieldMap",
    "FinishOnlyFilter",
    "FunctionAgent",
    "GymAgent",
    "HeldBatch",
    "Iteration",
    "LayoutError",
    "LocalProcessSandbox",
    "MultiDataSource",
    "NodeSpec",
    "PartialConfig",
    "PartialRollouts",
    "PlacementPool",
    "PluginError",
    "PoolError",
    "RejectionFilter",
    "Reservations",
    "Resource",
    "RolloutResult",
    "Sample",
    "SamplingParams",
    "SandboxError",
    "SandboxLimits",
    "SchedulerConfig",
    "Status",
    "StepKind",
    "StepState",
    "StepStatus",
    "StoppingCriteria",
    "Task",
    "TaskConfig",
    "TaskKey",
    "TaskRun",
    "TaskScheduler",
    "TerminationReason",
    "Token",
    "ToolAgent",
    "add_dagger_args",
    "apply_filters",
    "budget_batching",
    "budget_tokens",
    "build_sampling_params",
    "cascade",
    "classify_abort",
    "classify_termination",
    "connect",
    "eval_metrics",
    "failure_summary",
    "fifo_batching",
    "interleave",
    "is_solved",
    "load_strategy",
    "longest_first_batching",
    "make_sandbox",
    "parse_cluster_layout",
    "pass_at_k",
    "read_jsonl",
    "resolve_stopping",
    "roll_in_metrics",
    "run_virtual",
    "skyrl_gym_env",
    "tasks_from_rows",
]
