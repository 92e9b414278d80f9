"""The defaults of a DeepFM recipe's ``train:`` and ``daily:`` sections: plain data, read by the daily job and by
the recipe schema in :mod:`disttrain.recsys.model` (kept apart so neither imports the other)."""

DAILY_DEFAULTS = {"eval_fraction": 0.1, "auc_tolerance": 0.005, "min_auc": 0.55, "keep_versions": 3,
                  "max_bad_fraction": 0.01, "skip_missing_days": False, "train_late_days": False,
                  "on_invalid_day": "stop", "timeout": 300, "every": "1d", "full_every": None}
# daily.full_every when the config leaves it null: deltas between full versions, per cadence (0: every version full).
FULL_EVERY = {"1d": 0, "1h": 24}
TRAIN_DEFAULTS = {"batch_size": 512, "lr": 1e-3, "seed": 0}
