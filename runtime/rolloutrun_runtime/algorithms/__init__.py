"""RL algorithms: the single controller (rollout and train pumps), GRPO math, samplers."""
