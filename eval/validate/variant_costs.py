"""The cost models of the validation's variants, from the real runs' recorded steps: linear models fitted across
runs, per run or per system run, scaled by the machine probe or calibrated on a run's own decode steps, and this
machine's offline step table set to a run's level, with the serving terms fitted on the other runs."""
from __future__ import annotations

from dataclasses import replace

from eval.simulate.cost_model import (BatchShape, LinearCostModel, StepHistory, TableCostModel, TableWithServingTerms,
                                      fit_steps, step_histories)
from eval.simulate.step_table import StepTable


def fit(real: dict[float, dict], rates: list[float], members: list[str], system: str | None = None) -> LinearCostModel:
    """Fitted to the steps of the given rates' runs (of one system's run only when `system` is given), with the
    history terms where every run recorded its steps' start times (runs saved without them have none)."""
    observations, gaps = [], []
    path_in: list[float] = []
    path_out: list[float] = []
    histories: list[StepHistory] | None = []
    for rate in rates:
        for name, steps in real[rate]["steps"].items():
            if system is not None and name != system:
                continue
            observations += steps["observations"]
            gaps += steps["gaps_s"]
            path = steps.get("request_path") or {}
            path_in += path.get("in_s", [])
            path_out += path.get("out_s", [])
            starts = steps.get("starts_s")
            if starts is None or histories is None:
                histories = None
            else:
                histories += step_histories(starts, steps["observations"])
    coefficients, (after_idle, after_prefill) = fit_steps(observations, members, histories)
    overhead = sum(gaps) / len(gaps) if gaps else 0.0
    whose = f"{system}'s run" if system else "real bench runs"
    return LinearCostModel(coefficients, overhead, f"fitted to {len(observations)} steps of {whose} at rates "
                                                   f"{', '.join(map(str, rates))} on this machine", after_idle=after_idle,
                           after_prefill=after_prefill, path_s=(_median(path_in), _median(path_out)))


def _median(values: list[float]) -> float:
    """The median (0 for none: runs saved without the serving edge's timing have none)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def probe_of(real_rate: dict, system: str) -> float | None:
    """The median machine probe around one system's real run (None for runs saved before probes existed)."""
    probe = real_rate.get("probe_ms", {}).get(system)
    if not probe:
        return None
    return _median(probe["before"] + probe["after"])


def scaled(cost: LinearCostModel, factor: float, why: str = "by the machine probe") -> LinearCostModel:
    """The same cost model on a machine `factor` times slower (every coefficient and the loop overhead)."""
    idle, prefill = cost.after_idle, cost.after_prefill
    return LinearCostModel({m: tuple(c * factor for c in coef) for m, coef in cost.coefficients.items()},
                           cost.overhead_s * factor, f"{cost.source}, x{factor:.3f} {why}",
                           cost.copy_gb_s, after_idle=(idle[0] * factor, idle[1], idle[2]) if idle else None,
                           after_prefill=(prefill[0] * factor, prefill[1]) if prefill else None,
                           path_s=(cost.path_s[0] * factor, cost.path_s[1] * factor))


def probe_scaled(real: dict[float, dict], fit_rates: list[float], rate: float, systems: tuple[str, ...],
                 cost: LinearCostModel) -> dict[str, LinearCostModel] | None:
    """Per system: `cost` (fitted on fit_rates' runs) scaled by that run's probe over the fit runs' mean probe."""
    fitted_on = [p for r in fit_rates for n in real[r]["steps"] if (p := probe_of(real[r], n)) is not None]
    if not fitted_on or any(probe_of(real[rate], n) is None for n in systems):
        return None
    reference = sum(fitted_on) / len(fitted_on)
    return {n: scaled(cost, probe_of(real[rate], n) / reference) for n in systems}


def one_request_decode_steps(steps: dict) -> list[tuple[BatchShape, float]]:
    """A run's steps that were one member decoding one request alone: (its shape, seconds)."""
    return [(shapes[0], seconds) for shapes, seconds in steps["observations"]
            if len(shapes) == 1 and not shapes[0].prefills and len(shapes[0].decode_contexts) == 1]


def solo_decode_steps_s(steps: dict) -> dict[str, list[float]]:
    """Per member, the seconds of a run's one-request decode steps."""
    out: dict[str, list[float]] = {}
    for shape, seconds in one_request_decode_steps(steps):
        out.setdefault(shape.member, []).append(seconds)
    return out


def calibrated(real: dict[float, dict], fit_rates: list[float], rate: float, systems: tuple[str, ...],
               cost: LinearCostModel) -> dict[str, LinearCostModel] | None:
    """Per system: `cost` (fitted on fit_rates' runs) scaled by one number taken from that run's own steps: the
    median of its one-request decode steps of the member that has most of them, over the same median in the fit
    runs. The machine's speed during the run, measured where the probes around it miss it (a shared virtual
    machine drifts by 30-50% between runs minutes apart); everything else about the costs still comes from the other rates."""
    out = {}
    for name in systems:
        own = solo_decode_steps_s(real[rate]["steps"][name])
        reference: dict[str, list[float]] = {}
        for r in fit_rates:
            for steps in real[r]["steps"].values():
                for member, values in solo_decode_steps_s(steps).items():
                    reference.setdefault(member, []).extend(values)
        common = [m for m in own if len(own[m]) >= 20 and len(reference.get(m, [])) >= 20]
        if not common:
            return None
        member = max(common, key=lambda m: len(own[m]))
        out[name] = scaled(cost, _median(own[member]) / _median(reference[member]),
                           f"by {member}'s one-request decode steps in this run")
    return out


def at_level(table: StepTable, factor: float, note: str, overhead_s: float) -> StepTable:
    """The offline table `factor` times slower (the note says why), with `overhead_s` between steps."""
    return replace(table.scaled(factor, note), step_overhead_ms=overhead_s * 1e3)


def table_held_out(table: StepTable, real: dict[float, dict], fit_rates: list[float], overhead_s: float
                   ) -> TableCostModel:
    """The step table timed offline on this machine (eval.simulate.measure: every member's decode and prefill on a
    grid of batch sizes and contexts), scaled by one number: the median of real / table over every step of the
    fit runs (the serving loop's contention that an engine timed alone does not see), with the fit runs' gap
    between steps. Its batch-size dependence comes from the grid, not from the runs' mostly small batches."""
    model = TableCostModel(table)
    ratios = [seconds / predicted for r in fit_rates for steps in real[r]["steps"].values()
              for shapes, seconds in steps["observations"]
              if (predicted := sum(model.batch_s(shape) for shape in shapes)) > 0]
    factor = _median(ratios) or 1.0
    note = f"x{factor:.3f}: median real / table over {len(ratios)} steps of the runs at {', '.join(map(str, fit_rates))}"
    return TableCostModel(at_level(table, factor, note, overhead_s), name="table_held_out")


def decode_level(table: StepTable, runs: list[dict]) -> tuple[float, int] | None:
    """The machine's speed in these runs against the offline table: the median real / table of their one-request
    decode steps, and how many there were (None for fewer than 20: too few to say)."""
    model = TableCostModel(table)
    ratios = [seconds / predicted for steps in runs for shape, seconds in one_request_decode_steps(steps)
              if (predicted := model.batch_s(shape)) > 0]
    return (_median(ratios), len(ratios)) if len(ratios) >= 20 else None


def table_calibrated(table: StepTable, real_rate: dict, systems: tuple[str, ...], serving: LinearCostModel
                     ) -> dict[str, TableWithServingTerms] | None:
    """Per system: the step table timed offline on this machine, scaled to the machine's speed during that run (the
    median real / table of its one-request decode steps: one number from the run), with the serving loop's gap,
    the history terms and the serving edge of `serving` (fitted on the other rates' runs). The shape of every cost
    (batch size, context, prefill) comes from the offline grid, the level from the run, the serving terms from
    other runs: on a shared virtual machine, whose speed moves 30-50% between runs minutes apart, the variant that separates the
    simulated core's fidelity from the machine's drift with the least taken from the run itself."""
    out = {}
    for name in systems:
        level = decode_level(table, [real_rate["steps"][name]])
        if level is None:
            return None
        factor, count = level
        note = f"x{factor:.3f}: median real / table of the run's {count} one-request decode steps"
        out[name] = TableWithServingTerms(at_level(table, factor, note, serving.overhead_s), serving,
                                          name="table_calibrated")
    return out


def prefill_serving_extra_s(model: TableWithServingTerms, real: dict[float, dict], fit_rates: list[float]) -> float:
    """What a member batch holding a prefill chunk costs in serving beyond its price in `model` (built without such
    an extra): the median over the
    fit runs' steps that hold one of (real - the step's price, history terms included) per such batch. The engine
    timed alone prices decode steps within 1% in serving but prefill steps 0.15-1.4 ms low, about as much for 16
    tokens as for 200: a fixed amount, not a factor (docs/SIMULATOR.md, Validation)."""
    extras = []
    for rate in fit_rates:
        for steps in real[rate]["steps"].values():
            starts = steps.get("starts_s")      # runs saved without a timeline: no history terms
            histories = step_histories(starts, steps["observations"]) if starts is not None else None
            for index, (shapes, seconds) in enumerate(steps["observations"]):
                with_prefill = sum(1 for shape in shapes if shape.prefills)
                if not with_prefill:
                    continue
                priced = sum(model.batch_s(shape) for shape in shapes)
                if histories is not None:
                    priced += model.history_s(*histories[index])
                extras.append((seconds - priced) / with_prefill)
    return max(0.0, _median(extras))


def table_held_out_serving(table: StepTable, real: dict[float, dict], fit_rates: list[float],
                           serving: LinearCostModel) -> TableWithServingTerms | None:
    """Nothing from the simulated run: the step table timed offline at the fit runs' speed (decode_level of their
    runs), with the gap, history terms and serving edge of `serving` (fitted on the fit runs) and their
    prefill_serving_extra_s. table_calibrated with its one number taken from other runs, and the prefill steps
    priced as serving runs them."""
    level = decode_level(table, [steps for rate in fit_rates for steps in real[rate]["steps"].values()])
    if level is None:
        return None
    factor, count = level
    note = f"x{factor:.3f}: median real / table of {count} one-request decode steps at {', '.join(map(str, fit_rates))}"
    scaled_table = at_level(table, factor, note, serving.overhead_s)
    extra_s = prefill_serving_extra_s(TableWithServingTerms(scaled_table, serving), real, fit_rates)
    return TableWithServingTerms(scaled_table, serving, name="table_held_out_serving", prefill_extra_s=extra_s)
