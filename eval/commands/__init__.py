"""The commands that join the real bench (eval/bench/) and the simulator (eval/simulate/): the bench's baseline
split is re-scored on a simulated pilot, and the simulator reads the bench's workloads and maths, so what runs
both sits above both."""
