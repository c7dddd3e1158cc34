"""Learners, one module per algorithm (DQN, PPO, ALLO); `client.learner` is their command line and
`client.learners.common` what they share (progress, evaluation, the run folder)."""
