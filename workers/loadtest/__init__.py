"""Load tests on the deployment's host: AIPerf (its configuration and what it
says when it fails: aiperf), what it wrote (results), Triton's side of each
step (sampling), and the runs themselves (runs)."""
