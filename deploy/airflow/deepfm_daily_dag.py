"""Airflow DAG: the daily DeepFM job once a day, for the run's logical date. Copy into your dags/ folder.

``--run-date {{ ds }}`` makes each DAG run process the days up to its own date (a backfill of an old date trains
nothing new if the job already caught up; ``--force`` is not passed). Exit 3 (not published: AUC gate or a
diverged model) fails the task so it alerts; the job itself never overlaps (lock) and resumes after a crash.
"""

from datetime import datetime, timedelta

from airflow import DAG
from airflow.operators.bash import BashOperator

REPO = "/opt/disttrain"

with DAG(
    dag_id="deepfm_daily",
    schedule="30 2 * * *",
    start_date=datetime(2026, 11, 1),
    catchup=False,             # the job catches up on missed days itself
    max_active_runs=1,
    default_args={"retries": 1, "retry_delay": timedelta(minutes=15)},
    tags=["disttrain", "recsys"],
) as dag:
    BashOperator(
        task_id="train_and_publish",
        cwd=REPO,
        bash_command=(".venv/bin/python recipes/recsys/deepfm_daily.py --data-root /data/clicks"
                      " --model-root /models/deepfm --run-date {{ ds }}"),
        execution_timeout=timedelta(hours=6),
    )
