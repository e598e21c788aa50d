"""The job verl runs: its overrides by concern, the rollout's fit beside the actor, the trainer modes, which actor trains."""
