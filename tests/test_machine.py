"""settings.machine (eval/machine.py): the CPU model and its core counts, recorded by bench and simulate alike, and
skipped by `python -m eval.simulate.compare_runs` like every other field that describes the machine."""
from __future__ import annotations

from eval.machine import cpu_model, machine, physical_cores
from eval.simulate.compare_runs import differences

# two sockets of 2 cores with 2 threads each: 8 logical processors, 4 physical cores
CPUINFO = "".join(f"processor\t: {n}\nmodel name\t: Example CPU @ 2.00GHz\nphysical id\t: {n // 4}\n"
                  f"core id\t\t: {(n // 2) % 2}\n\n" for n in range(8))


def test_the_cpu_model_and_the_physical_cores_come_from_cpuinfo():
    assert cpu_model(CPUINFO) == "Example CPU @ 2.00GHz"
    assert physical_cores(CPUINFO) == 4


def test_without_cpuinfo_the_model_falls_back_to_platform(tmp_path):
    found = machine(cpuinfo=tmp_path / "absent")
    assert found["cpu_count"] >= 1 and found["python"]
    assert isinstance(found["cpu_model"], str) or found["cpu_model"] is None
    assert {"cpu_model", "cpu_count", "cpu_physical_cores", "cpu_usable", "torch"} <= set(found)


def test_this_machine_is_described():
    found = machine()
    assert found["cpu_model"] and found["cpu_count"] >= found["cpu_usable"] >= 1
    assert found["cpu_physical_cores"] is None or 1 <= found["cpu_physical_cores"] <= found["cpu_count"]


def test_compare_runs_skips_the_machine():
    a = {"settings": {"seed": 0, "machine": machine()}, "figure": 1.5}
    b = {"settings": {"seed": 0, "machine": {**machine(), "cpu_model": "another CPU", "cpu_count": 96}},
         "figure": 1.5}
    assert differences(a, b) == []
    assert differences(a, {**b, "figure": 1.25}) == ["/figure: 1.5 vs 1.25"]
    assert differences({"settings": {"seed": 0}, "figure": 1.5}, b) == []    # a result from before the field
