"""Side-effecting rollout code: environments, prompts, parsing, the rollout loop."""
