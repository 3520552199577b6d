"""Several training runs in one process, or in each process of one launch (the sequence-parallel tests: one
launch's start-up serves every method). argv: RECIPE OUT [RECIPE OUT ...]; each run as `erniekit-lite train` runs
it, in order; the process group (a launch's) is torn down once, after the last."""

from __future__ import annotations

import sys

from erniekit_lite import recipe as recipes
from erniekit_lite.launch import begin_process_group, end_process_group, print_on_main
from erniekit_lite.train import method_runner

begin_process_group()
pairs = sys.argv[1:]
for path, out in zip(pairs[::2], pairs[1::2]):
    r = recipes.load(path, [f"output.dir={out}"])
    method_runner(r.method)(r, log=print_on_main)
end_process_group()
