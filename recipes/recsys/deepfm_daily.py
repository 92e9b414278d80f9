"""Daily DeepFM retraining: warm start from the published model, catch up on every unprocessed day in date order
(each validated against the days before it), evaluate on the newest day's held-out rows, publish atomically only a
finite model whose AUC clears the floor and did not regress.

    python recipes/recsys/deepfm_daily.py --data-root DIR --model-root DIR [--run-date YYYY-MM-DD] [--force]
    torchrun --nproc_per_node 8 recipes/recsys/deepfm_daily.py --config configs/recsys/deepfm_5b.yaml ...

Exit status: 0 published or nothing to do, 3 trained but not published (AUC gate, or the model diverged), 1 failed
(one line on stderr says why; --verbose adds the traceback).
"""

import sys

from disttrain.recsys.daily import main

if __name__ == "__main__":
    sys.exit(main())
