"""The machine under a run: the job's processes and environment, Ray's start and nodes, a lost node, the run's scope and reaper."""
