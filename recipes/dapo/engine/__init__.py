"""What runs inside verl's workers: the mcore_ep engine, its config, passes, batches, log-probs, routes, guards, metrics, weights and the weight channel."""
