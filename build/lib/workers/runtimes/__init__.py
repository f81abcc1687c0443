"""Where a deployment's Triton server runs: a local process (runtimes.process)
or a Docker container (runtimes.docker, the one module that talks to the
Docker engine, build containers included), both behind runtimes.base.Runtime."""
