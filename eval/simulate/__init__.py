"""`mfs simulate`: the real MFS core (scheduler, router, page pool, KV cache manager, escalation monitor, tiers)
driven by a virtual clock, with a simulated executor whose step durations come from a cost model.

clock.py        virtual time and the event queue
cost_model.py   the cost-model interface (a step's shape in, seconds out): step-table and fitted linear models
step_table.py   the `mfs-step-table/1` file: per-member decode and prefill grids, interpolation
aic_table.py    builds a step table with NVIDIA aiconfigurator (runs in its own virtual environment)
measure.py      builds a step table by timing the local engine on this machine
families.py     paper-scale families (HF configs, shipped tokenizer) and GPU memory -> KV pages
confidence.py   per-token confidences recorded from the real tiny family, looked up deterministically
escalation_model.py  a stated parametric model of when requests escalate (paper-scale families)
executor.py     SimExecutor: the StepExecutor the core drives; tokens from a seeded stream
node.py         one serving node: the core as EngineCore assembles it, stepped in virtual time
fleet.py        placements (colocated, per-member, fleet:N) and the front router of a fleet
setup.py        the family, cost model, memory -> pages and GPU settings a simulation runs on
driver.py       replays a bench trace through the nodes in virtual time -> the bench's records
cli.py          `mfs simulate` arguments, the result JSON (the bench schema plus `simulated`)

compiled.py     the mypyc build of the hot modules (the core's and the simulator's), activated here

With MFS_COMPILED_CORE set to an up-to-date build (`make compile-core`), the hot modules of the core and of the
simulator (executor, clock, node, fleet, confidence, cost_model) come from it: activated when this package is first
imported, before any of them is.
"""

from eval.simulate.compiled import activate as _activate

_activate()

