"""Pipeline parallelism: a Sequential cut into stages over ranks, run with GPipe, 1F1B or interleaved 1F1B."""

from axond.parallel.pipeline.pipeline import LossFn, Pipeline
from axond.parallel.pipeline.schedules import Action, PipelineSchedule, peak_in_flight, rank_actions
from axond.parallel.pipeline.split import Stage, balanced_split_points, split_sequential

__all__ = [
    "Action",
    "LossFn",
    "Pipeline",
    "PipelineSchedule",
    "Stage",
    "balanced_split_points",
    "peak_in_flight",
    "rank_actions",
    "split_sequential",
]
