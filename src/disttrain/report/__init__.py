"""Runs a person can watch and compare: progress output, Lightning's standard loggers under a run folder, and the
run report (``report.png`` + ``report.md``) drawn from the logs; the daily job's model-history report."""

from disttrain.report.loggers import DEFAULT_LOGGERS, LOGGER_NAMES, fabric_loggers, parse_logger_spec, \
    read_run_info, start_run, strategy_description, trainer_loggers, write_run_info
from disttrain.report.progress import PlainProgress, StepProgress, interactive, trainer_progress_callbacks
from disttrain.report.run import PANELS, ReportError, read_metrics, summarize, write_report

__all__ = ["DEFAULT_LOGGERS", "LOGGER_NAMES", "PANELS", "PlainProgress", "ReportError", "StepProgress",
           "fabric_loggers", "interactive", "parse_logger_spec", "read_metrics", "read_run_info", "start_run",
           "strategy_description", "summarize", "trainer_loggers", "trainer_progress_callbacks", "write_report",
           "write_run_info"]
