"""``python perf/slow_producer.py SECONDS ARGS...``: ``examples/precompute_cache.py ARGS...`` with every
``compute_batch`` slowed by ``SECONDS`` (a target model slower than training), for ``bench_follow.py``
and the follow tests.

Only the compute is slowed (a real sleep in the producer process); what it writes, the command it
records and everything else are the example's own, so ``precompute_cache.py ARGS...`` resumes it.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

import te_thd.offline_cache.write.producer as producer

DELAY = float(sys.argv[1])
_real = producer.lockstep_write


def _slowed(loader, out, shard_size, runs, compute_batch, *args, **kwargs):
    def slow(batch):
        time.sleep(DELAY)
        return compute_batch(batch)

    return _real(loader, out, shard_size, runs, slow, *args, **kwargs)


producer.lockstep_write = _slowed
script = Path(__file__).resolve().parents[1] / "examples" / "precompute_cache.py"
sys.argv = [str(script), *sys.argv[2:]]
runpy.run_path(str(script), run_name="__main__")
