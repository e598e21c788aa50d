"""`python -m converters`: a process that only converts, set up as such.

- The model is only ever built on the meta device, no kernel runs: megatron's import-time
  torch.compile wrappers (which import dynamo and inductor) are made pass-throughs before
  megatron is imported (by the layout, later).
- The interpreter's teardown is skipped once the output is complete and fsynced (`exit_now`):
  its final garbage collection over torch's and megatron's objects would only cost time.
Figures: converters/README.md, "Start-up".
"""

import torch

from converters.cli import exit_now, main


def _pass_through(model=None, **options):
    return model if model is not None else _pass_through


torch.compile = _pass_through

# the guard matters: megatron's checkpoint code may start worker processes
if __name__ == "__main__":
    exit_now(main())
