"""``python -m tokenbudget.worker`` with a fault injected for the fault tests.

A step whose sampler sees a request seeded with FAULT_SEED raises as a logits
processor would on parameters it cannot handle; the message names a source
file, which must not reach the client. Everything else is the real worker.
"""

from __future__ import annotations

import sys

from tokenbudget.worker import sampler
from tokenbudget.worker.__main__ import main

FAULT_SEED = 2989
_from_params = sampler.SamplingMetadata.from_params.__func__


def _faulty_from_params(cls, params, *args, **kwargs):
    if any(p.seed == FAULT_SEED for p in params):
        raise RuntimeError(
            f"injected fault for seed {FAULT_SEED} in /opt/tokenbudget/worker/logits_processors.py"
        )
    return _from_params(cls, params, *args, **kwargs)


sampler.SamplingMetadata.from_params = classmethod(_faulty_from_params)

if __name__ == "__main__":
    main(sys.argv[1:])
